"""The engine's C++ CPU kernels (``engine/csrc/``), built once with g++ against the installed torch.

``paged_decode_attention()`` returns the op (``torch.ops.pdserve_native.paged_decode_attention``)
or None where it cannot be had: no g++ on the machine (the slim CPU image), a failed build, or
the environment sets ``PDSERVE_NATIVE_KERNELS=0``. Callers then keep the pure-torch path (the
same results; measured slower, docs/benchmarks.md). The first call builds the library (under a
minute) into ``${PDSERVE_CACHE:-~/.cache/pdserve}/native/<hash of source, torch, compiler>/``
under a file lock (servers starting side by side build it once); later calls, in any process,
load it in milliseconds. ``make test-deps`` and ``make serve`` build it ahead
(``python -m pdserve.engine.native``), so no server waits on the compiler.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .defaults import NATIVE_KERNELS_ENV

log = logging.getLogger(__name__)
SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode.cpp"
HEAD_DIMS = (16, 32, 64, 128, 256)  # the head sizes the kernel is compiled for (its by_dim switch)
_state: dict = {}  # "op" once loaded, or "error": why not (tried once per process)
_variants: dict = {}  # namespace -> op, for build_variant


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve")) / "native"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def _build_command(cxx: str, out: Path, march: str = "native", source: Path = SOURCE) -> list[str]:
    """g++ for the library; ``march`` other than native builds one ISA level's code path (tests)."""
    import torch
    from torch.utils.cpp_extension import include_paths

    lib = Path(torch.__file__).parent / "lib"
    return [cxx, "-O3", f"-march={march}", "-ffast-math", "-fopenmp-simd", "-shared", "-fPIC", "-std=c++20",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *[f"-I{p}" for p in include_paths()], str(source), f"-L{lib}", "-ltorch", "-ltorch_cpu", "-lc10",
            f"-Wl,-rpath,{lib}", "-o", str(out)]


def cpu_flags() -> str:
    """This CPU's flags line of /proc/cpuinfo ("" elsewhere): part of every kernel cache key."""
    if not Path("/proc/cpuinfo").exists():
        return ""
    return next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")


def library_path(cxx: str) -> Path:
    """Where the library built from this source, for this torch and compiler, is cached
    (``-march=native``: the machine's CPU flags are part of the key too)."""
    import torch

    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), torch.__version__.encode(), cxx.encode(),
                                      cpu_flags().encode()]))
    return cache_dir() / key.hexdigest()[:16] / "paged_decode.so"


def build(verbose: bool = False) -> Path:
    """Build the library if it is not cached yet; its path. Raises RuntimeError naming the cause."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, or $CXX) on this machine")
    out = library_path(cxx)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then find it built
        if out.exists():
            return out
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        if verbose:
            print(f"building the engine's C++ kernels ({SOURCE.name}, under a minute) ...", file=sys.stderr, flush=True)
        done = subprocess.run(_build_command(cxx, tmp), capture_output=True, text=True)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            errors = [ln for ln in done.stderr.splitlines() if "error" in ln] or done.stderr.splitlines()[-5:]
            raise RuntimeError(f"building {SOURCE.name} with {cxx} failed: " + " | ".join(errors[:5]))
        tmp.rename(out)
    return out


def build_variant(namespace: str, *, march: str = "native", source_text: str | None = None):
    """The op built apart, registered under ``namespace``: this source (or ``source_text``, e.g. the
    kernel at another git revision for ``bench/tools/native_attention.py --against``) for
    ``-march=march`` (the tests build each ISA level's path, AVX2 or plain loops, whatever the
    machine's native build takes). Cached in ``cache_dir()/variants/``; RuntimeError names the cause."""
    import torch

    if namespace in _variants:
        return _variants[namespace]
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, or $CXX) on this machine")
    text = (SOURCE.read_text() if source_text is None else source_text).replace(
        "TORCH_LIBRARY(pdserve_native,", f"TORCH_LIBRARY({namespace},")
    key = hashlib.sha256("\0".join([text, march, torch.__version__, cxx, cpu_flags()]).encode()).hexdigest()[:16]
    out = cache_dir() / "variants" / key / f"{namespace}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        src, tmp = out.with_suffix(f".{os.getpid()}.cpp"), out.with_suffix(f".{os.getpid()}.tmp")
        src.write_text(text)
        done = subprocess.run(_build_command(cxx, tmp, march, src), capture_output=True, text=True)
        src.unlink(missing_ok=True)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            errors = [ln for ln in done.stderr.splitlines() if "error" in ln] or done.stderr.splitlines()[-5:]
            raise RuntimeError(f"building {namespace} (-march={march}) failed: " + " | ".join(errors[:5]))
        tmp.rename(out)
    torch.ops.load_library(str(out))
    _variants[namespace] = getattr(torch.ops, namespace).paged_decode_attention
    return _variants[namespace]


def paged_decode_attention():
    """The op, or None (with the reason logged once per process) where it cannot be had."""
    if "op" in _state or "error" in _state:
        return _state.get("op")
    if os.environ.get(NATIVE_KERNELS_ENV, "1") == "0":
        _state["error"] = f"{NATIVE_KERNELS_ENV}=0"
        return None
    try:
        import torch

        torch.ops.load_library(str(build()))
        _state["op"] = torch.ops.pdserve_native.paged_decode_attention
    except (RuntimeError, OSError) as e:
        _state["error"] = str(e)
        log.warning("C++ decode attention unavailable, using the torch path: %s", e)
    return _state.get("op")


def unavailable_reason() -> str | None:
    """Why ``paged_decode_attention()`` returned None, or None when it did not."""
    paged_decode_attention()
    return _state.get("error")


def main() -> int:
    """``python -m pdserve.engine.native``: build (or find) the kernels; exit 0 even without a
    compiler (the engine falls back), printing which it is."""
    try:
        print(f"engine C++ kernels: {build(verbose=True)}")
    except RuntimeError as e:
        print(f"engine C++ kernels not built ({e}); the engine uses its torch path", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
