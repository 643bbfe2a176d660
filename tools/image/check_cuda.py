"""The CUDA image's check, run inside the built image without a GPU (tools/image/build.sh --cuda runs it
before exporting the image; `make image-cuda-check` runs it again on the stored image).

1. torch is a CUDA build, and every CUDA library it needs loads: the libraries torch/lib links
   (transitively) under nvidia/, and those they open by name at run time (cuDNN's sub-libraries,
   NVRTC's builtins), each dlopen'ed with RTLD_NOW. The rest of nvidia/ is tried too and reported.
2. NIXL: pdserve's own path (cachestore.nixl_backend.NixlMemory) makes an agent with the UCX
   backend and registers host memory; the UCX plugin and UCX's CUDA transports (libuct_cuda,
   libucm_cuda) are present and load.
3. Triton compiles two of the engine's kernels (gpu_attention's paged decode, gpu_elementwise's
   RMSNorm) ahead of time for sm_90 (GPUTarget('cuda', 90, 32): Triton -> PTX -> ptxas -> cubin),
   then builds its launcher (driver.c, against Python.h and cuda.h) with the image's C compiler.

Without a GPU there is no driver: libcuda.so.1 and libnvidia-ml.so.1 are the node's, mounted into a
GPU pod by the NVIDIA container toolkit. The check builds stand-ins for them with the image's gcc,
exporting exactly the driver symbols the loaded libraries ask for (nm), in a temporary directory
that is not part of the image; every other dependency must resolve from the image itself.
Exit status 0 only if every step passed; the output names what failed.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

SITE = Path(sysconfig.get_paths()["purelib"])
# The driver's libraries (not in the image) and the symbols of theirs a library may ask for.
DRIVER = {"libcuda.so.1": re.compile(r"^cu[A-Z]\w*$"), "libnvidia-ml.so.1": re.compile(r"^nvml\w*$")}
# Opened by name at run time by the libraries torch links, so not in any DT_NEEDED.
OPENED_BY_NAME = ("nvidia/cudnn/lib/libcudnn_*.so.*", "nvidia/*/lib/libnvrtc-builtins.so.*")
failures: list[str] = []


def step(name: str, ok: bool, detail: str = "") -> None:
    print(f"[{'ok' if ok else 'FAILED'}] {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        failures.append(name)


def run(cmd: list[str]) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def needed(path: Path) -> list[str]:
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", run(["readelf", "-d", str(path)]))


def undefined(path: Path) -> set[str]:
    """The symbols ``path`` needs from other objects (strong ones: weak undefined symbols may stay unresolved)."""
    lines = (line.split() for line in run(["nm", "-D", "--undefined-only", str(path)]).splitlines())
    return {fields[-1].split("@")[0] for fields in lines if fields and fields[0] == "U"}


def rel(path: Path) -> str:
    return os.path.relpath(path, SITE) if str(path).startswith(str(SITE)) else str(path)


def is_elf_library(path: Path) -> bool:
    if path.is_symlink() or not path.is_file() or ".so" not in path.name:
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def driver_stubs(libraries: list[Path], out: Path) -> None:
    """Stand-ins for the driver's libraries, loaded RTLD_GLOBAL so that later dlopens resolve against them."""
    cc = shutil.which("gcc")
    if cc is None:
        sys.exit("check_cuda: no gcc in the image (Triton needs a C compiler)")
    for soname, pattern in DRIVER.items():
        symbols = sorted({s for lib in libraries if soname in needed(lib) for s in undefined(lib) if pattern.match(s)})
        src = out / f"{soname}.c"
        src.write_text("".join(f"int {s}(void) {{ return 100; }}\n" for s in symbols) or "int unused_stub;\n")
        subprocess.run([cc, "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(out / soname), str(src)], check=True)
        ctypes.CDLL(str(out / soname), mode=os.RTLD_GLOBAL)
        print(f"  stand-in {soname}: {len(symbols)} symbols asked for by the libraries below")


def load_all(paths: list[Path]) -> dict[Path, str]:
    """dlopen every path (RTLD_NOW | RTLD_GLOBAL), dependencies first by retrying; path -> error of the failures."""
    left, errors = list(paths), {}
    while left:
        errors = {}
        for path in left:
            try:
                ctypes.CDLL(str(path), mode=os.RTLD_GLOBAL)
            except OSError as exc:
                errors[path] = str(exc)
        if len(errors) == len(left):
            break
        left = list(errors)
    return errors


def torch_closure(torch_libs: list[Path], nvidia_libs: list[Path]) -> list[Path]:
    """The nvidia/ libraries torch/lib links, transitively, and those they open by name."""
    by_soname: dict[str, Path] = {}
    for lib in nvidia_libs:
        for name in (lib.name, *[p.name for p in lib.parent.iterdir() if p.is_symlink() and p.resolve() == lib]):
            by_soname.setdefault(name, lib)
    todo, seen = list(torch_libs), set()
    while todo:
        for name in needed(todo.pop()):
            lib = by_soname.get(name)
            if lib is not None and lib not in seen:
                seen.add(lib)
                todo.append(lib)
    for pattern in OPENED_BY_NAME:
        seen.update(Path(p) for p in glob.glob(str(SITE / pattern)) if is_elf_library(Path(p)))
    return sorted(seen)


def check_torch(stubs: Path, more: list[Path]) -> None:
    """torch's libraries; the driver stand-ins are made for them and for ``more`` (loaded later)."""
    import torch

    step("torch is a CUDA build", torch.version.cuda is not None and torch.backends.cuda.is_built(),
         f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
    torch_libs = sorted(p for p in (SITE / "torch/lib").iterdir() if is_elf_library(p))
    nvidia_libs = sorted({p.resolve() for p in (SITE / "nvidia").rglob("*.so*") if is_elf_library(p)})
    required = torch_closure(torch_libs, nvidia_libs)
    driver_stubs(torch_libs + nvidia_libs + more, stubs)
    errors = load_all(torch_libs + required)
    size = sum(p.stat().st_size for p in required) / 1e6
    step("torch's CUDA libraries load", not errors,
         f"{len(torch_libs)} torch/lib + {len(required)} nvidia/ libraries ({size:.0f} MB) dlopen'ed"
         + "".join(f"\n    {p}: {e}" for p, e in errors.items()))
    for path in required:
        print(f"    {rel(path)} ({path.stat().st_size / 1e6:.0f} MB)")
    others = [p for p in nvidia_libs if p not in required]
    other_errors = load_all(others)
    print(f"  the other {len(others)} nvidia/ libraries (torch does not link them): "
          f"{len(others) - len(other_errors)} load" + "".join(
              f"\n    not loadable here: {rel(p)}: {e.removeprefix(str(p) + ': ')}" for p, e in other_errors.items()))


def nixl_package() -> Path:
    from pdserve.cachestore.nixl_backend import load_nixl

    return Path(load_nixl().__file__).parent.parent


def ucx_cuda_transports() -> list[Path]:
    return [Path(p) for p in sorted(glob.glob(str(nixl_package() / "nixl_cu13.libs/ucx/lib[u]c[mt]_cuda.so*")))]


def check_nixl_agent() -> None:
    """Before any driver stand-in is loaded: UCX then finds no libcuda.so.1, as on a node without a GPU."""
    import torch

    from pdserve.cachestore.memory import MemoryRegion
    from pdserve.cachestore.nixl_backend import NixlMemory, load_nixl

    api = load_nixl()
    step("NIXL imports as pdserve loads it", api.__name__.startswith("nixl_cu13"), api.__name__)
    plugin = sorted(nixl_package().glob(".nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so"))
    step("NIXL's UCX plugin is present", bool(plugin), rel(plugin[0]) if plugin else "missing")
    region = MemoryRegion.from_tensor(torch.zeros(1 << 16, dtype=torch.uint8))
    memory = NixlMemory("check", region)
    try:
        step("a NIXL agent with the UCX backend registers memory", "UCX" in memory.agent.backends,
             f"backends {sorted(memory.agent.backends)}, {len(memory.metadata())} bytes of agent metadata")
    finally:
        memory.close()


def check_ucx_cuda(transports: list[Path]) -> None:
    names = sorted(p.name.split(".so")[0] for p in transports)
    step("UCX's CUDA transports are present", names == ["libucm_cuda", "libuct_cuda"], ", ".join(names))
    errors = load_all(transports)
    step("UCX's CUDA transports load", not errors and bool(transports),
         "; ".join(f"{p.name} needs {', '.join(needed(p))}" for p in transports)
         + "".join(f"\n    {p}: {e}" for p, e in errors.items()))


def compile_kernels() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    from pdserve.engine import gpu_attention, gpu_elementwise, triton_jit

    target = GPUTarget("cuda", 90, 32)
    attention = triton_jit.kernels(gpu_attention._BODIES, interpret=False)
    elementwise = triton_jit.kernels(gpu_elementwise._BODIES, interpret=False)
    i32, bf16, f32 = "i32", "*bf16", "*fp32"
    kernels = {
        "gpu_attention.decode_partials": ASTSource(attention.decode_partials, signature={
            "Q": bf16, "KV": bf16, "TABLES": "*i32", "STARTS": "*i32", "ENDS": "*i32", "M_OUT": f32, "L_OUT": f32,
            "ACC_OUT": f32, "scale": "fp32", "softcap": "fp32", **{n: i32 for n in (
                "blocks_per_split", "num_heads", "stride_qb", "stride_qh", "stride_kvn", "stride_kvkv", "stride_kvt",
                "stride_kvh", "stride_tb", "stride_tn")}, **{n: "constexpr" for n in (
                    "HEAD_DIM", "DIM_P", "GROUP", "GROUP_P", "BLOCK_SIZE", "SOFTCAP", "DOT_TY")}},
            constexprs={"HEAD_DIM": 128, "DIM_P": 128, "GROUP": 4, "GROUP_P": 16, "BLOCK_SIZE": 16,
                        "SOFTCAP": False, "DOT_TY": triton.language.bfloat16}),
        "gpu_elementwise.rms_norm": ASTSource(elementwise.rms_norm, signature={
            "X": bf16, "W": bf16, "OUT": bf16, "eps": "fp32", "n_cols": i32, "stride_x": i32, "stride_o": i32,
            "BLOCK": "constexpr"}, constexprs={"BLOCK": 4096}),
    }
    print(f"  triton {triton.__version__}; ptxas for sm_90: {get_ptxas(90).path} ({get_ptxas(90).version})")
    for name, src in kernels.items():
        start = time.monotonic()
        try:
            compiled = triton.compile(src, target=target, options={"num_warps": 4})
        except Exception as exc:  # the compiler's error is the finding
            step(f"Triton compiles {name} for sm_90", False, repr(exc)[-2000:])
            continue
        cubin = compiled.asm.get("cubin", b"")
        step(f"Triton compiles {name} for sm_90", len(cubin) > 0 and ".target sm_90" in compiled.asm["ptx"],
             f"{len(cubin)} bytes of cubin, {compiled.metadata.shared} bytes of shared memory, "
             f"{time.monotonic() - start:.1f} s")


def build_launcher(stubs: Path) -> None:
    from triton.runtime.build import _find_compiler

    os.environ["TRITON_LIBCUDA_PATH"] = str(stubs)  # where the launcher links libcuda.so.1 (the node's, in a pod)
    cc = _find_compiler("c")
    start = time.monotonic()
    flags = sys.getdlopenflags()
    sys.setdlopenflags(os.RTLD_LAZY | os.RTLD_GLOBAL)  # its driver calls bind on first use (there is no driver here)
    try:
        from triton.backends.nvidia.driver import CudaUtils

        utils = CudaUtils()
    except Exception as exc:
        step("Triton builds its launcher with the image's C compiler", False, repr(exc)[-2000:])
        return
    finally:
        sys.setdlopenflags(flags)
    module = sys.modules[utils.launch.__module__] if getattr(utils.launch, "__module__", None) in sys.modules else None
    path = Path(module.__file__) if module is not None and getattr(module, "__file__", None) else None
    if path is None:
        path = next(iter(sorted(Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton/cache")).rglob(
            "cuda_utils*.so"))), None)
    if path is None:
        step("Triton builds its launcher with the image's C compiler", False, "no cuda_utils*.so in Triton's cache")
        return
    # Everything the launcher asks for besides the driver's calls must already resolve in this process.
    missing = [s for s in undefined(path) if not DRIVER["libcuda.so.1"].match(s) and not hasattr(ctypes.CDLL(None), s)]
    driver_calls = sorted(s for s in undefined(path) if DRIVER["libcuda.so.1"].match(s))
    step("Triton builds its launcher with the image's C compiler", callable(utils.launch) and not missing,
         f"{cc} built {path.name} in {time.monotonic() - start:.1f} s; it calls {len(driver_calls)} driver functions"
         + (f"; unresolved: {missing}" if missing else ""))


def main() -> None:
    """``--triton-only``: step 3 alone, in any environment with triton and gcc (the test suite runs it in the
    development venv: tests/unit/test_triton_sm90_compile.py)."""
    triton_only = sys.argv[1:] == ["--triton-only"]
    if sys.argv[1:] and not triton_only:
        sys.exit("usage: check_cuda.py [--triton-only]")
    start = time.monotonic()
    print(f"check_cuda: {sys.executable}, site-packages {SITE}", flush=True)
    with tempfile.TemporaryDirectory(prefix="check-cuda-") as tmp:
        stubs = Path(tmp)
        os.environ.setdefault("TRITON_CACHE_DIR", str(stubs / "triton-cache"))
        if not triton_only:
            check_nixl_agent()
            transports = ucx_cuda_transports()
            check_torch(stubs, transports)
            check_ucx_cuda(transports)
        else:
            driver_stubs([], stubs)  # an empty libcuda.so.1 to link the launcher against
        compile_kernels()
        build_launcher(stubs)
    print(f"check_cuda: {'FAILED: ' + ', '.join(failures) if failures else 'all passed'} "
          f"({time.monotonic() - start:.0f} s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
