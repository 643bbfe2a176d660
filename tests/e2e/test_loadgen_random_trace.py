"""`pdserve bench serving --dataset random` against a real P/D cluster (1 prefill + 1 decode
processes, loopback) on a small checkpoint whose tokenizer covers every id: exact lengths,
Poisson arrivals, TTFT/TPOT/ITL in the JSON and the table, every request accounted for, and
nothing held by the servers afterwards."""

import json
import subprocess

import pytest

from pdserve.bench.experiments.peer_model import peer_model
from harness.pd_cluster import nothing_held, start_decode, start_prefill, wait_all_released, wait_ready
from harness.procs import VENV_BIN

pytestmark = pytest.mark.slow

PROMPT, OUTPUT, N = 40, 12, 10


def test_bench_serving_random_trace_against_a_pd_cluster(procs, tmp_path):
    model = str(peer_model(tmp_path / "models", "tiny", 1024))
    decode = start_decode(procs, extra=["--model", model])
    wait_ready(decode)
    prefill = start_prefill(procs, [decode.grpc_address], extra=["--model", model])
    wait_ready(prefill)
    out = tmp_path / "bench"
    proc = subprocess.run([str(VENV_BIN / "pdserve"), "bench", "serving", "--base-url", prefill.url, "--model", model,
                           "--dataset", "random", "--tokenizer", model, "--prompt-len", str(PROMPT),
                           "--output-len", str(OUTPUT), "--num-requests", str(N), "--request-rate", "5",
                           "--warmup", "1", "--out", str(out), "--name", "trace", "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for row in ("TTFT", "TPOT", "ITL", "e2e"):
        assert row in proc.stdout
    doc = json.loads((out / "trace.json").read_text())
    assert doc["config"]["url"] == prefill.url and doc["config"]["dataset"] == "random"
    s = doc["summary"]
    assert (s["requests"], s["succeeded"], s["failed"], s["errors"]) == (N, N, 0, {})
    assert [r["index"] for r in doc["requests"]] == list(range(N))
    for r in doc["requests"]:
        assert r["ok"] and r["error"] == ""
        # exact lengths: the prompt is PROMPT ids, ignore_eos gives OUTPUT tokens
        assert (r["usage_prompt_tokens"], r["usage_completion_tokens"]) == (PROMPT, OUTPUT)
        assert 1 <= r["chunks"] <= OUTPUT and len(r["gaps"]) == r["chunks"] - 1
        assert 0 < r["ttft"] <= r["e2e"]
    sent = [r["sent_at"] for r in doc["requests"]]
    assert sent == sorted(sent) and sent[-1] > 0  # Poisson arrivals, in order, spread out
    assert s["output_tokens"] == N * OUTPUT and s["prompt_tokens"] == N * PROMPT
    assert s["tpot_s"]["count"] == N and s["tpot_s"]["p50"] <= s["tpot_s"]["p99"]
    assert s["tbt_s"]["count"] == sum(len(r["gaps"]) for r in doc["requests"])
    assert s["output_token_throughput"] > 0
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings


def test_random_dataset_without_a_tokenizer_is_refused(tmp_path):
    proc = subprocess.run([str(VENV_BIN / "pdserve"), "bench", "serving", "--dataset", "random", "--num-requests", "1",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--dataset random needs --tokenizer" in proc.stderr
    assert not list(tmp_path.iterdir())
