# syntax=docker/dockerfile:1.7
# One image for the operator, prefill and decode: the entry point is `pdserve`, the pod picks
# the command (`pdserve operator`, `pdserve prefill ...`, `pdserve decode ...`; the operator
# writes the server command lines, the Helm chart writes the operator's).
#
# CPU image (default):
#   docker build -t pdserve:cpu .
# CPU image where only PyPI is reachable (its Linux torch wheel is the CUDA build: the nvidia-* libraries
# it links against come along; what a CPU image never loads is pruned; tools/image/build.sh does this
# with buildah, no Docker needed):
#   docker build -t pdserve:cpu --build-arg TORCH_INDEX=https://pypi.org/simple \
#     --build-arg PRUNE="triton nvidia-cusolver nvidia-cuda-cccl" --build-arg PRUNE_NVIDIA=1 .
# CUDA image (torch's CUDA wheels and NIXL/UCX for GPU-to-GPU KV transfer):
#   docker build -t pdserve:cuda \
#     --build-arg BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#     --build-arg EXTRAS=nixl .
#
# Ports the servers listen on are in pdserve/defaults.py (the one place for them).

# The base of both stages: a Python >= 3.11 image (CPU) or a CUDA runtime image (Python from apt).
ARG BASE=python:3.12-slim-bookworm

# ---- build: a virtual environment with pdserve and its dependencies ----------------------
FROM ${BASE} AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN if ! command -v python3 >/dev/null 2>&1 || ! python3 -c 'import venv, ensurepip' 2>/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv && rm -rf /var/lib/apt/lists/*; \
    fi \
 && python3 -m venv /opt/pdserve
WORKDIR /src
# Dependencies first (cached while only the sources change), read from pyproject.toml: torch
# alone from TORCH_INDEX (CPU or CUDA build), then everything else from PyPI.
COPY pyproject.toml ./
RUN /opt/pdserve/bin/python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' > /tmp/deps.txt \
 && grep '^torch' /tmp/deps.txt > /tmp/torch.txt \
 && /opt/pdserve/bin/pip install --index-url "${TORCH_INDEX}" -r /tmp/torch.txt \
 && /opt/pdserve/bin/pip install -r /tmp/deps.txt
# Then the package itself (a regular, non-editable install of the folders pyproject.toml maps;
# README.md is its long description, copied here so that editing it keeps the dependency layer).
COPY README.md ./
COPY pdserve ./pdserve
COPY engine ./engine
COPY cachestore ./cachestore
COPY protos ./protos
COPY prefill_server ./prefill_server
COPY batch ./batch
COPY decode_server ./decode_server
COPY operator ./operator
COPY router ./router
COPY planner ./planner
COPY kvpool ./kvpool
COPY bench ./bench
COPY localcluster ./localcluster
COPY vllm_backend ./vllm_backend
# Packages to uninstall after the install, ones the image never loads (the CPU image from PyPI's
# CUDA torch: triton is only for torch.compile and the engine's attention kernels on CUDA
# (engine/gpu_attention.py), cuSOLVER only for CUDA linear algebra, CCCL only headers). PRUNE_NVIDIA=1 (CPU image from PyPI's CUDA torch only) then deletes every file of the
# nvidia-* packages that `pdserve generate` on the built-in model does not load (measured under
# LD_DEBUG; cuDNN's engines, NVSHMEM's bitcode, headers: ~1.2 GB; see the script). Declared here, so
# that changing them keeps the cached layers above.
COPY tools/image/prune_nvidia.py /tmp/prune_nvidia.py
ARG PRUNE=""
ARG PRUNE_NVIDIA=""
RUN /opt/pdserve/bin/pip install ".${EXTRAS:+[$EXTRAS]}" \
 && if [ -n "${PRUNE}" ]; then /opt/pdserve/bin/pip uninstall --yes ${PRUNE}; fi \
 && if [ "${PRUNE_NVIDIA}" = 1 ]; then /opt/pdserve/bin/python /tmp/prune_nvidia.py; fi \
 && rm /tmp/prune_nvidia.py \
 && /opt/pdserve/bin/pdserve --help >/dev/null \
 && cd / && /opt/pdserve/bin/python -c 'import torch; torch.ones(2, 2) @ torch.ones(2, 2)'

# ---- runtime: the same base, the virtual environment, a non-root user --------------------
FROM ${BASE} AS runtime
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update && apt-get install -y --no-install-recommends python3 && rm -rf /var/lib/apt/lists/*; \
    fi \
 && groupadd --gid 10001 pdserve \
 && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin pdserve
COPY --from=build /opt/pdserve /opt/pdserve
# The root file system is read-only in the pods: everything writable lives under /tmp (an emptyDir).
ENV PATH=/opt/pdserve/bin:${PATH} \
    HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001
ENTRYPOINT ["pdserve"]
CMD ["--help"]
