# syntax=docker/dockerfile:1.7
# One image for the operator, prefill and decode: the entry point is `pdserve`, the pod picks
# the command (`pdserve operator`, `pdserve prefill ...`, `pdserve decode ...`; the operator
# writes the server command lines, the Helm chart writes the operator's). Two kinds (KIND):
#
# CPU image (default):
#   docker build -t pdserve:cpu .
# CPU image where only PyPI is reachable (its Linux torch wheel is the CUDA build: the nvidia-* libraries
# it links against come along; what a CPU image never loads is pruned; tools/image/build.sh does this
# with buildah, no Docker needed):
#   docker build -t pdserve:cpu --build-arg TORCH_INDEX=https://pypi.org/simple \
#     --build-arg PRUNE="triton nvidia-cusolver nvidia-cuda-cccl" --build-arg PRUNE_NVIDIA=1 .
# CUDA image (`make image-cuda`: tools/image/build.sh --cuda): no CUDA base image. The CUDA user-space
# libraries are the nvidia-* wheels PyPI's Linux torch (a CUDA 13 build) depends on; the driver
# (libcuda.so.1, libnvidia-ml.so.1) is the node's, mounted into the pod by the NVIDIA container
# toolkit. KIND=cuda adds nixl-cu13 (NIXL and UCX with its CUDA transports, for GPU-to-GPU KV
# transfer), deletes what a GPU pod never loads (tools/image/prune_cuda.py) and puts a C
# compiler and the Python headers in the runtime stage: Triton builds its launcher with them the first
# time a kernel runs.
#   docker build -t pdserve:cuda --build-arg KIND=cuda --build-arg TORCH_INDEX=https://pypi.org/simple .
#
# Ports the servers listen on are in pdserve/defaults.py (the one place for them).

# The base of both stages: a Python >= 3.11 image (or a Debian one with python3 and python3-venv: tools/image).
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
# LD_DEBUG; cuDNN's engines, NVSHMEM's bitcode, headers: ~1.2 GB; see the script). KIND=cuda runs
# prune_cuda.py instead (headers, static archives, device bitcode, profilers,
# Triton's AMD backend: what a GPU pod never loads; see the script). These ARGs are declared here, so
# that changing them keeps the cached dependency layer above: one layer for both kinds (which is also
# why the CUDA image's NIXL is not an extra of its own: pyproject.toml is that layer's input). KIND=cuda
# installs NIXL's CUDA 13 build (nixl-cu13: PyPI's torch is a CUDA 13 build, and nixl-cu12 would bring
# CUDA 12's runtime beside it) at the version pyproject.toml's `nixl` extra pins, the one place for it.
COPY tools/image/prune_nvidia.py tools/image/prune_cuda.py /tmp/
ARG PRUNE=""
ARG PRUNE_NVIDIA=""
ARG KIND=cpu
RUN case "${KIND}" in cpu|cuda) ;; *) echo "KIND must be cpu or cuda, not '${KIND}'" >&2; exit 2 ;; esac \
 && /opt/pdserve/bin/pip install ".${EXTRAS:+[$EXTRAS]}" \
 && if [ "${KIND}" = cuda ]; then \
        /opt/pdserve/bin/pip install "$(/opt/pdserve/bin/python -I -c 'import tomllib; (pin,) = [d for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["nixl"] if d.startswith("nixl-cu12==")]; print(pin.replace("nixl-cu12", "nixl-cu13"))')"; \
    fi \
 && if [ -n "${PRUNE}" ]; then /opt/pdserve/bin/pip uninstall --yes ${PRUNE}; fi \
 && if [ "${PRUNE_NVIDIA}" = 1 ]; then /opt/pdserve/bin/python /tmp/prune_nvidia.py; fi \
 && if [ "${KIND}" = cuda ]; then /opt/pdserve/bin/python /tmp/prune_cuda.py; fi \
 && rm /tmp/prune_nvidia.py /tmp/prune_cuda.py \
 && /opt/pdserve/bin/pdserve --help >/dev/null \
 && cd / && /opt/pdserve/bin/python -c 'import torch; torch.ones(2, 2) @ torch.ones(2, 2)'

# ---- runtime: the same base, the virtual environment, a non-root user --------------------
# KIND=cuda: a C compiler (gcc, libc6-dev) and, where the base lacks them, the Python headers
# (libpython3-dev): Triton compiles its launcher (driver.c, against Python.h) the first time a kernel
# runs in a pod, into $HOME/.triton (an emptyDir).
FROM ${BASE} AS runtime
ARG KIND=cpu
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update && apt-get install -y --no-install-recommends python3 && rm -rf /var/lib/apt/lists/*; \
    fi \
 && if [ "${KIND}" = cuda ]; then \
        packages="gcc libc6-dev"; \
        python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_config_var("INCLUDEPY"), "Python.h")))' \
            || packages="${packages} libpython3-dev"; \
        apt-get update && apt-get install -y --no-install-recommends ${packages} \
        && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb /usr/share/doc/* /usr/share/man/* \
        && rm -f /usr/lib/x86_64-linux-gnu/libpython3*.a /usr/lib/python3*/config-*/libpython3*.a; \
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
