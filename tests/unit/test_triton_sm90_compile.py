"""The engine's Triton kernels compile for an H100 (sm_90) without a GPU, and Triton's launcher builds with
the machine's C compiler: step 3 of the CUDA image's check (tools/image/check_cuda.py --triton-only), run
in the development venv so that every suite run catches a kernel change that Triton can interpret (the
other tests run the kernels under its interpreter) but not compile for Hopper. The whole image check runs
with `make image-cuda` / `make image-cuda-check` (tools/image/README.md says why not here).

One subprocess (its own Triton cache in a temporary directory): about 25 s on the 2-core development box.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.procs import REPO

pytestmark = pytest.mark.slow


def test_engine_kernels_compile_for_sm90_and_the_launcher_builds():
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "image" / "check_cuda.py"), "--triton-only"],
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for line in ("[ok] Triton compiles gpu_attention.decode_partials for sm_90",
                 "[ok] Triton compiles gpu_elementwise.rms_norm for sm_90",
                 "[ok] Triton builds its launcher with the image's C compiler"):
        assert line in out, out[-4000:]
    assert "check_cuda: all passed" in out


def test_the_check_refuses_unknown_arguments():
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "image" / "check_cuda.py"), "--bogus"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "usage: check_cuda.py [--triton-only]" in proc.stderr
