#!/usr/bin/env bash
# Build (or reuse) the environments of the two standard serving benchmarks that docs/benchmarks.md runs
# against pdserve ("inference-perf and aiperf against pdserve"): each tool in its own virtual
# environment OUTSIDE the repository, never pdserve's .venv, never among pdserve's dependencies:
#   ${PDSERVE_CACHE:-$HOME/.cache/pdserve}/bench-tools/inference-perf-0.7.0/venv   (kubernetes-sigs)
#   ${PDSERVE_CACHE:-$HOME/.cache/pdserve}/bench-tools/aiperf-0.13.0/venv          (NVIDIA Dynamo)
#
# Two environments, not one: inference-perf 0.7.0 wants aiofiles>=25.1 and transformers==5.13.0,
# aiperf 0.13.0 aiofiles~=24.1. Each installs exactly its lock file beside this script
# (requirements-<tool>.txt: every package pinned, resolved on CPython 3.12 / Linux x86_64).
# inference-perf needs Python >= 3.12 (aiperf < 3.14): the interpreter is $PYTHON, else the first
# python3.12 / python3.13 on PATH, else one under pyenv's versions (~/.pyenv/versions/3.12.*).
#
# Idempotent: a stamp in each environment records the hash of its lock file; when it matches, a run
# only prints where the environments are (about a second). A changed lock file rebuilds that one.
# When the package index cannot be reached, the script says so in one line (exit 1) instead of
# pip's retries.
#
# Usage: tools/bench_tools/install.sh            install what is missing; prints one line per tool:
#                                                "<tool> <path of its bin/ folder>"
#        tools/bench_tools/install.sh --check    the same lines if both are installed and current, else exit 1
# Environment: PDSERVE_CACHE (cache root), PYTHON (interpreter for the environments, 3.12 or 3.13).
set -euo pipefail

TOOLS=("inference-perf==0.7.0" "aiperf==0.13.0")
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="${PDSERVE_CACHE:-$HOME/.cache/pdserve}/bench-tools"

die() { echo "bench-tools: ERROR: $*" >&2; exit 1; }
say() { echo "[bench-tools] $*" >&2; }

venv_of() { local spec="$1"; echo "$ROOT/${spec%%==*}-${spec##*==}/venv"; }
lock_of() { echo "$HERE/requirements-${1%%==*}.txt"; }
want_of() { echo "$1 $(sha256sum "$(lock_of "$1")" | cut -c1-16)"; }
current() { local v; v="$(venv_of "$1")"; [[ -x "$v/bin/python" && -f "$v/.pdserve-stamp" && "$(cat "$v/.pdserve-stamp")" == "$(want_of "$1")" ]]; }
report() { local spec; for spec in "${TOOLS[@]}"; do echo "${spec%%==*} $(venv_of "$spec")/bin"; done; }

if [[ "${1:-}" == "--check" ]]; then
  for spec in "${TOOLS[@]}"; do
    current "$spec" || { echo "bench-tools: no current ${spec} environment at $(venv_of "$spec") (build it with: bash tools/bench_tools/install.sh)" >&2; exit 1; }
  done
  report
  exit 0
fi
[[ $# -eq 0 ]] || { echo "usage: $0 [--check]" >&2; exit 2; }

all_current=1
for spec in "${TOOLS[@]}"; do current "$spec" || all_current=0; done
if (( all_current )); then report; exit 0; fi

fits() { "$1" -c 'import sys; sys.exit(not ((3, 12) <= sys.version_info[:2] < (3, 14)))' >/dev/null 2>&1; }
find_python() {
  local cand
  if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; return; fi
  # a pyenv shim on PATH may name a version that is not selected: try each candidate
  for cand in python3.12 python3.13 "$HOME"/.pyenv/versions/3.12.*/bin/python3.12 "$HOME"/.pyenv/versions/3.13.*/bin/python3.13; do
    if command -v "$cand" >/dev/null 2>&1 && fits "$(command -v "$cand")"; then command -v "$cand"; return; fi
  done
}
PY="$(find_python)"
[[ -n "$PY" ]] || die "inference-perf 0.7.0 needs Python 3.12 or 3.13 and none was found (python3.12/3.13 on PATH or under ~/.pyenv/versions); set PYTHON to one"
fits "$PY" || die "inference-perf 0.7.0 needs Python >= 3.12 and aiperf 0.13.0 < 3.14; $PY is $("$PY" --version 2>&1) (set PYTHON)"

mkdir -p "$ROOT"
# Python puts the working directory first on sys.path for `-m`; the repository's top-level folders
# (operator/, ...) would shadow the standard library, so work from the cache.
cd "$ROOT"
exec 9>"$ROOT/.install.lock"
if ! flock -n 9; then
  say "another install holds $ROOT/.install.lock; waiting for it"
  flock 9
fi

# One cheap question to the index before the long installs: can pip see the pinned tool at all?
probe="$(mktemp -d)"
trap 'rm -rf "$probe"' EXIT
if ! "$PY" -m pip download --disable-pip-version-check --quiet --no-deps --timeout 20 --retries 1 \
      --dest "$probe" "${TOOLS[0]}" >"$probe/log" 2>&1; then
  index="$("$PY" -m pip config list 2>/dev/null | grep -i 'index-url' | head -n1 || true)"
  die "the package index is unreachable or lacks ${TOOLS[0]} (pip's index: ${index:-the default, PyPI}); these tools install from PyPI only. pip said: $(grep -v '^\s*$' "$probe/log" | tail -n1)"
fi

for spec in "${TOOLS[@]}"; do
  current "$spec" && continue
  venv="$(venv_of "$spec")"
  lock="$(lock_of "$spec")"
  rm -f "$venv/.pdserve-stamp"
  if [[ ! -x "$venv/bin/python" ]]; then
    say "creating $venv ($("$PY" --version))"
    "$PY" -m venv "$venv"
  fi
  say "installing $spec from $(basename "$lock") ($(grep -c '==' "$lock") pinned packages)"
  "$venv/bin/python" -m pip install --disable-pip-version-check --quiet -r "$lock" \
    || die "pip could not install $lock into $venv (see the lines above)"
  "$venv/bin/python" -m pip check --disable-pip-version-check >/dev/null \
    || die "$venv is inconsistent after installing $lock: $("$venv/bin/python" -m pip check 2>&1 | head -n3)"
  tool="${spec%%==*}"
  version="$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('$tool'))")"
  [[ "$version" == "${spec##*==}" ]] || die "$venv has $tool $version, not ${spec##*==}"
  want_of "$spec" > "$venv/.pdserve-stamp"
  say "done: $tool $version, $(du -sh "$venv" | cut -f1) in $venv"
done
report
