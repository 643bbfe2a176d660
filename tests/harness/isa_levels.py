"""The engine's C++ kernels' code paths as test parameters, one place for the kernel tests that build them.

``ISA_LEVELS``: "native" (the library ``-march=native`` built) and each code path besides it, built apart
for an x86-64 level (``native.build_variant`` / ``build_library_variant``): x86-64-v4 is the AVX-512 path,
v3 the AVX2 (+ FMA, F16C) one, plain x86-64 the loops; all must give the same results. Every level is
collected on every CPU (the same tests everywhere); a level this CPU cannot execute is skipped, naming the
missing instructions. ``needs_compiler``: the kernels are built with g++ (without one the engine keeps its
torch paths).
"""

from __future__ import annotations

import shutil

import pytest

from pdserve.engine import native

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++: the engine uses its torch paths")
_CPU_FLAGS = native.cpu_flags().split()
ISA_LEVELS = ["native"] + [
    pytest.param(level, marks=pytest.mark.skipif(flag not in _CPU_FLAGS, reason=f"this CPU has no {flag}: "
                                                 f"the {level} build cannot run here"))
    for level, flag in (("x86-64-v4", "avx512f"), ("x86-64-v3", "avx2"), ("x86-64", "sse2"))]


def namespace(prefix: str, level: str) -> str:
    """The torch.ops namespace of one level's build, e.g. pdserve_fp8_x86_64_v3."""
    return f"{prefix}_{level.replace('-', '_')}"
