#!/usr/bin/env bash
# The GPU check's entry point, run from the repository root on the GPU machine:
#
#     bash tools/gpu/check.sh [OUTDIR] [check.py options...]
#
# OUTDIR: default $OUT if set, else ./gpu-check-out. Everything printed also goes to
# OUTDIR/check.log; the results are OUTDIR/check.json (and OUTDIR/sections/*.json).
#  1. .whl/*.whl (from tools/gpu/fetch_wheels.sh, carried to the machine) -> /tmp/site, first on
#     PYTHONPATH (pip --target; without pip the wheels are unzipped, which is all a wheel is).
#  2. pdserve without its pinned dependencies: pip --target /tmp/pdserve-site (no index, no deps,
#     no build isolation); when that fails, a tree of symbolic links (tools/gpu/link_package.py);
#     when `import pdserve.engine` still fails, a clear error and exit status 2.
#  3. python3 tools/gpu/check.py --out OUTDIR (unbuffered; exit status = check.py's).
# `python3 -P` wherever a module or -c runs from here: the repository root has an operator/
# folder (pdserve.operator), and Python 3.12 would import it as the standard library's `operator`
# if the working directory were on sys.path (`python3 -m pip` from here then dies at start).
set -uo pipefail
cd "$(dirname "$0")/../.."

OUTDIR=${1:-${OUT:-gpu-check-out}}
shift || true
mkdir -p "$OUTDIR"
LOG="$OUTDIR/check.log"
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

stamp() { echo "[$(date +%H:%M:%S)] check.sh: $*"; }

install_wheels() {
    shopt -s nullglob
    local wheels=(.whl/*.whl)
    shopt -u nullglob
    if [ ${#wheels[@]} -eq 0 ]; then
        stamp "no .whl/ wheels (tools/gpu/fetch_wheels.sh makes them): relying on what is installed"
        return
    fi
    stamp "installing ${#wheels[@]} wheels into /tmp/site: ${wheels[*]}"
    if ! "$PY" -P -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "${wheels[@]}"; then
        stamp "pip could not install them; unzipping the wheels into /tmp/site instead"
        "$PY" -P -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall("/tmp/site") for w in sys.argv[1:]]' \
            "${wheels[@]}" || stamp "WARNING: the wheels are not installed"
    fi
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
}

install_pdserve() {
    rm -rf /tmp/pdserve-site
    stamp "installing pdserve (no deps) into /tmp/pdserve-site"
    if ! "$PY" -P -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/pdserve-site . \
            > /tmp/pdserve-pip.log 2>&1; then
        stamp "pip could not install pdserve; the end of its log:"
        tail -n 15 /tmp/pdserve-pip.log
        stamp "falling back to a tree of links (tools/gpu/link_package.py)"
        rm -rf /tmp/pdserve-site
        "$PY" tools/gpu/link_package.py /tmp/pdserve-site
    fi
    export PYTHONPATH=/tmp/pdserve-site${PYTHONPATH:+:$PYTHONPATH}
    # from /tmp: the repository root's pdserve/ folder must not shadow the installed package
    if ! (cd /tmp && "$PY" -c "import pdserve.engine.llm_engine, pdserve.cachestore.sender, pdserve.prefill_server.cli"); then
        stamp "ERROR: pdserve is not importable with PYTHONPATH=$PYTHONPATH (see the traceback above;"
        stamp "a missing module there is a wheel to add to tools/gpu/fetch_wheels.sh)"
        return 2
    fi
    stamp "pdserve importable from $(cd /tmp && "$PY" -c 'import pdserve, os; print(os.path.dirname(pdserve.__file__))')"
}

main() {
    stamp "start in $(pwd), output in $OUTDIR; $("$PY" --version 2>&1)"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version \
        --format=csv,noheader || stamp "no nvidia-smi"
    install_wheels
    install_pdserve || return 2
    stamp "running tools/gpu/check.py --out $OUTDIR $*"
    PYTHONUNBUFFERED=1 "$PY" tools/gpu/check.py --out "$OUTDIR" "$@"
}

main "$@" 2>&1 | tee -a "$LOG"
rc=$?
echo "[$(date +%H:%M:%S)] check.sh: exit status $rc (log: $LOG)" | tee -a "$LOG"
exit $rc
