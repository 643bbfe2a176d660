"""The engine's C++ CPU kernels (``engine/csrc/``), built once with g++ against the installed torch.

Two libraries, one source each: ``paged_decode.cpp`` (decode attention over the paged cache) and
``fp8_linear.cpp`` (FP8 weights read in place, ``fp8_ops()``: ``torch.ops.pdserve_fp8``).
``paged_decode_attention()`` returns the op (``torch.ops.pdserve_native.paged_decode_attention``)
or None where it cannot be had: no g++ on the machine (the slim CPU image) or a failed build
(``EngineConfig.native_kernels`` off: the runner does not ask). Callers then keep the pure-torch path (the
same results; measured slower, docs/benchmarks.md). The first call builds the library (under a
minute) into ``<cache root>/native/<hash of source, torch, compiler>/`` (the root: ``~/.cache/pdserve``,
or what ``set_cache_root`` was given: pdserve's CLI gives ``$PDSERVE_CACHE``)
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


log = logging.getLogger(__name__)
SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode.cpp"
FP8_SOURCE = SOURCE.with_name("fp8_linear.cpp")
# each source -> the torch library (namespace) it registers
LIBRARIES = {SOURCE: "pdserve_native", FP8_SOURCE: "pdserve_fp8"}
# -fopenmp: at::parallel_for is OpenMP in torch's headers (without the flag it runs on one thread); the
# library then needs libgomp.so.1, which resolves to the copy torch has loaded (the same soname), so it
# shares torch's threads and torch.set_num_threads. The attention kernel was measured without it.
EXTRA_FLAGS = {FP8_SOURCE: ["-fopenmp"]}
HEAD_DIMS = (16, 32, 64, 128, 256)  # the head sizes the kernel is compiled for (its by_dim switch)
_state: dict = {}  # "op" once loaded, or "error": why not (tried once per process)
_fp8_state: dict = {}  # the same for fp8_ops(): "ops" or "error"
_variants: dict = {}  # namespace -> op, for build_variant
_cache_root: dict[str, Path] = {}  # "root": set_cache_root's (default ~/.cache/pdserve)


def set_cache_root(root: str | Path) -> None:
    """Where the built libraries go (``<root>/native``), set once by the process's entry point: pdserve's CLI
    passes ``$PDSERVE_CACHE`` (the engine reads no environment of ours)."""
    _cache_root["root"] = Path(root)


def cache_dir() -> Path:
    return _cache_root.get("root", Path.home() / ".cache" / "pdserve") / "native"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def _build_command(cxx: str, out: Path, march: str = "native", source: Path = SOURCE,
                   library_source: Path | None = None) -> list[str]:
    """g++ for the library; ``march`` other than native builds one ISA level's code path (tests);
    ``library_source``: the source ``source`` is a variant of (its flags), when not itself."""
    library_source = library_source or source
    import torch
    from torch.utils.cpp_extension import include_paths

    lib = Path(torch.__file__).parent / "lib"
    return [cxx, "-O3", f"-march={march}", "-ffast-math", "-fopenmp-simd", *EXTRA_FLAGS.get(library_source, []),
            "-shared", "-fPIC", "-std=c++20",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *[f"-I{p}" for p in include_paths()], str(source), f"-L{lib}", "-ltorch", "-ltorch_cpu", "-lc10",
            f"-Wl,-rpath,{lib}", "-o", str(out)]


def cpu_flags() -> str:
    """This CPU's flags line of /proc/cpuinfo ("" elsewhere): part of every kernel cache key."""
    if not Path("/proc/cpuinfo").exists():
        return ""
    return next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")


def library_path(cxx: str, source: Path = SOURCE) -> Path:
    """Where the library built from ``source``, for this torch and compiler, is cached
    (``-march=native``: the machine's CPU flags are part of the key too)."""
    import torch

    key = hashlib.sha256(b"\0".join([source.read_bytes(), torch.__version__.encode(), cxx.encode(),
                                      cpu_flags().encode(), *(f.encode() for f in EXTRA_FLAGS.get(source, []))]))
    return cache_dir() / key.hexdigest()[:16] / f"{source.stem}.so"


def build(verbose: bool = False, source: Path = SOURCE) -> Path:
    """Build the library of ``source`` if it is not cached yet; its path. Raises RuntimeError naming the cause."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, or $CXX) on this machine")
    out = library_path(cxx, source)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then find it built
        if out.exists():
            return out
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        if verbose:
            print(f"building the engine's C++ kernels ({source.name}, under a minute) ...", file=sys.stderr, flush=True)
        done = subprocess.run(_build_command(cxx, tmp, source=source), capture_output=True, text=True)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            errors = [ln for ln in done.stderr.splitlines() if "error" in ln] or done.stderr.splitlines()[-5:]
            raise RuntimeError(f"building {source.name} with {cxx} failed: " + " | ".join(errors[:5]))
        tmp.rename(out)
    return out


def build_variant(namespace: str, *, march: str = "native", source_text: str | None = None):
    """The attention op built apart, registered under ``namespace``: this source (or ``source_text``, e.g.
    the kernel at another git revision for ``bench/tools/native_attention.py --against``) for
    ``-march=march`` (the tests build each ISA level's path, AVX2 or plain loops, whatever the
    machine's native build takes). Cached in ``cache_dir()/variants/``; RuntimeError names the cause."""
    if namespace not in _variants:
        _variants[namespace] = build_library_variant(namespace, SOURCE, march=march,
                                                     source_text=source_text).paged_decode_attention
    return _variants[namespace]


def build_library_variant(namespace: str, source: Path, *, march: str = "native", source_text: str | None = None):
    """``source``'s library built apart under ``namespace`` for ``-march=march``: its ``torch.ops`` namespace."""
    import torch

    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, or $CXX) on this machine")
    library = LIBRARIES[source]
    text = (source.read_text() if source_text is None else source_text).replace(
        f"TORCH_LIBRARY({library},", f"TORCH_LIBRARY({namespace},").replace(
        f"TORCH_LIBRARY_IMPL({library},", f"TORCH_LIBRARY_IMPL({namespace},")
    key = hashlib.sha256("\0".join([text, march, torch.__version__, cxx, cpu_flags(),
                                     *EXTRA_FLAGS.get(source, [])]).encode()).hexdigest()[:16]
    out = cache_dir() / "variants" / key / f"{namespace}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        src, tmp = out.with_suffix(f".{os.getpid()}.cpp"), out.with_suffix(f".{os.getpid()}.tmp")
        src.write_text(text)
        done = subprocess.run(_build_command(cxx, tmp, march, src, source), capture_output=True, text=True)
        src.unlink(missing_ok=True)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            errors = [ln for ln in done.stderr.splitlines() if "error" in ln] or done.stderr.splitlines()[-5:]
            raise RuntimeError(f"building {namespace} (-march={march}) failed: " + " | ".join(errors[:5]))
        tmp.rename(out)
    torch.ops.load_library(str(out))  # (dlopen of a path already loaded is a no-op)
    return getattr(torch.ops, namespace)


def fp8_ops():
    """``torch.ops.pdserve_fp8`` (fp8_linear, fp8_dequantize), or None (the reason logged once per process)."""
    if "ops" in _fp8_state or "error" in _fp8_state:
        return _fp8_state.get("ops")
    try:
        import torch

        torch.ops.load_library(str(build(source=FP8_SOURCE)))
        _fp8_state["ops"] = torch.ops.pdserve_fp8
    except (RuntimeError, OSError) as e:
        _fp8_state["error"] = str(e)
        log.warning("C++ FP8 kernels unavailable, FP8 weights are widened per call in torch (slow): %s", e)
    return _fp8_state.get("ops")


def paged_decode_attention():
    """The op, or None (with the reason logged once per process) where it cannot be had."""
    if "op" in _state or "error" in _state:
        return _state.get("op")
    try:
        import torch

        torch.ops.load_library(str(build()))
        _state["op"] = torch.ops.pdserve_native.paged_decode_attention
    except (RuntimeError, OSError) as e:
        _state["error"] = str(e)
        log.warning("C++ decode attention unavailable, using the torch path: %s", e)
    return _state.get("op")


def fp8_unavailable_reason() -> str | None:
    """Why ``fp8_ops()`` returned None, or None when it did not."""
    fp8_ops()
    return _fp8_state.get("error")


def unavailable_reason() -> str | None:
    """Why ``paged_decode_attention()`` returned None, or None when it did not."""
    paged_decode_attention()
    return _state.get("error")


def main(argv: list[str] | None = None) -> int:
    """``python -m pdserve.engine.native [--cache-root DIR]``: build (or find) the kernels; exit 0 even without
    a compiler (the engine falls back), printing which it is."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pdserve.engine.native", description=main.__doc__)
    parser.add_argument("--cache-root", default=None, help="where <root>/native goes (default ~/.cache/pdserve)")
    args = parser.parse_args(argv)
    if args.cache_root:
        set_cache_root(args.cache_root)
    for source in LIBRARIES:
        try:
            print(f"engine C++ kernels: {build(verbose=True, source=source)}")
        except RuntimeError as e:
            print(f"engine C++ kernels ({source.name}) not built ({e}); the engine uses its torch path",
                  file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
