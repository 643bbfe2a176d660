"""`pdserve bench serving` end to end against a real `pdserve up` cluster (1 prefill + 1 decode,
tiny model, loopback): every request streams through P/D and the figures add up."""

import json
import subprocess
import time
import urllib.request

import pytest

from pdserve.net import free_port
from harness.procs import VENV_BIN, wait_for_port

pytestmark = pytest.mark.slow


def test_bench_serving_against_pdserve_up(procs, tmp_path):
    port, grpc_port = free_port(), free_port()
    up = procs.pdserve("up", "--model", "tiny", "--prefill", "1", "--decode", "1", "--threads", "1",
                       "--port", str(port), "--grpc-port", str(grpc_port), "--log-dir", str(tmp_path / "cluster"),
                       name="up")
    wait_for_port(port, timeout=180, proc=up)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:  # pdserve up opens the port before every decode is known
        try:
            if urllib.request.urlopen(url + "/ready", timeout=2).status == 200:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, "the cluster never became ready"
        time.sleep(0.2)
    out = tmp_path / "bench"
    proc = subprocess.run([str(VENV_BIN / "pdserve"), "bench", "serving", "--url", url, "--num-requests", "12",
                           "--concurrency", "3", "--token-ids", "256", "--prompt-len", "48", "--max-prompt-len", "200",
                           "--output-len", "8", "--max-output-len", "16", "--warmup", "1", "--slo-ttft-ms", "60000",
                           "--slo-tbt-ms", "60000", "--out", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((out / "serving.json").read_text())
    s = doc["summary"]
    assert s["succeeded"] == 12 and s["failed"] == 0
    for r in doc["requests"]:
        # ignore_eos: exactly max_tokens tokens; the server's count of the prompt matches what was sent
        assert r["usage_completion_tokens"] == r["output_tokens"]
        assert r["prompt_tokens"] <= r["usage_prompt_tokens"] <= r["prompt_tokens"] + 1  # + BOS if added
        assert r["ttft"] > 0 and r["e2e"] >= r["ttft"]
        assert r["chunks"] >= 1
    assert s["output_tokens"] == sum(r["output_tokens"] for r in doc["requests"])
    assert s["goodput"] == pytest.approx(s["request_throughput"])  # generous SLO: every request meets it
    assert s["ttft_s"]["p50"] <= s["ttft_s"]["p99"] <= s["e2e_s"]["max"]
    assert (out / "serving.png").stat().st_size > 10_000
