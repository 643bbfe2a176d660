"""Delete what a GPU pod of the CUDA image never loads (image build step, Dockerfile KIND=cuda).

The CUDA image's user-space CUDA is the nvidia-* wheels PyPI's torch depends on; Triton and
nixl-cu13 bring their own parts. Every shared library torch links or opens (cuBLAS(Lt), cuFFT,
cuSPARSE(Lt), cuSOLVER, cuDNN and all its engine libraries, NCCL, NVSHMEM and its transports,
NVRTC, nvJitLink, cuFile, CUPTI) stays: tools/image/check_cuda.py opens each of them in the built
image. What goes is listed below, each with why no pod loads it; nothing is deleted by a pattern
that is not listed. Run with the image's Python: ``python prune_cuda.py`` (no arguments); it prints
what it freed per rule and fails if a rule matched nothing (the wheels changed: look again).
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import sysconfig

# (pattern under site-packages, why no GPU pod of pdserve loads it)
RULES = (
    ("nvidia/*/include", "CUDA, cuDNN, NCCL, NVSHMEM headers: compiling against CUDA (no nvcc in the image)"),
    ("nvidia/*/lib/*.a", "static archives: linking CUDA programs"),
    ("nvidia/*/lib/*.bc", "NVSHMEM's and NCCL's device bitcode: compiling kernels that call them"),
    ("nvidia/cu13/lib/libcusolverMg.so*", "multi-GPU cuSOLVER: torch links libcusolver only"),
    ("nvidia/cu13/lib/libnvblas.so*", "nvBLAS, the drop-in host BLAS over cuBLAS: not torch's"),
    ("nvidia/cu13/lib/libcufftw.so*", "the FFTW interface to cuFFT: not torch's"),
    ("nvidia/cu13/lib/libnvperf_*.so", "CUPTI's range profiler (torch's profiler uses CUPTI's activity API)"),
    ("nvidia/cu13/lib/libpcsamplingutil.so", "CUPTI's PC sampling utility"),
    ("nvidia/cu13/lib/libcheckpoint.so", "CUPTI's checkpoint API"),
    ("torch/include", "torch's C++ headers: building C++ extensions (no C++ compiler in the image)"),
    ("triton/backends/amd/lib", "Triton's AMD code generator and device libraries: compiling for AMD GPUs only "
     "(its Python modules stay: Triton imports every backend it finds)"),
    ("triton/backends/amd/include", "HIP headers for Triton's AMD launcher"),
    ("triton/backends/nvidia/lib/cupti*", "two more CUPTI copies, for Triton's profiler (proton)"),
    ("triton/_C/libproton.so", "Triton's profiler (proton)"),
    ("triton/backends/nvidia/bin/cuobjdump", "a disassembler for Triton's debug dumps"),
    ("triton/backends/nvidia/bin/nvdisasm", "a disassembler for Triton's debug dumps"),
    ("nixl_ep_cu13", "NIXL EP (expert-parallel all-to-all), built for torch 2.12-2.14 and unused by pdserve"),
    ("nixl_cu13.libs/nixl", "a second copy of NIXL's plugins: NIXL loads them from .nixl_cu13.mesonpy.libs/plugins"),
)


def size_of(path: str) -> int:
    if os.path.islink(path) or os.path.isfile(path):
        return os.lstat(path).st_size
    return sum(os.lstat(os.path.join(d, n)).st_size for d, _, names in os.walk(path) for n in names)


def main() -> None:
    site = sysconfig.get_paths()["purelib"]
    total, empty = 0, []
    for pattern, why in RULES:
        paths = sorted(glob.glob(os.path.join(site, pattern)))
        if not paths:
            empty.append(pattern)
            continue
        freed = sum(size_of(p) for p in paths)
        for path in paths:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        total += freed
        print(f"prune_cuda: {freed / 1e6:7.1f} MB  {pattern}  ({why})")
    if empty:
        sys.exit(f"prune_cuda: these rules matched nothing (did the wheels change?): {empty}")
    print(f"prune_cuda: removed {total / 1e6:.0f} MB under {site}")


if __name__ == "__main__":
    main()
