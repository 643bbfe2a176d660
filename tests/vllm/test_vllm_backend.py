"""P/D over the vLLM engine backend (`pdserve prefill|decode --engine vllm`, vllm_backend/), real
processes: the greedy tokens equal vLLM's colocated output for the same checkpoint and prompts,
one request at a time and as a concurrent batch, with the prompt's KV moved by the CacheStore
(the decode received it) over tcp and over nixl; logprobs (/v1/completions with and without echo,
chat, whole and streamed) equal vLLM's own within 1e-4; every KV block, Session and CacheStore entry
is back to zero after success, after a client abort, and after either peer is killed mid-request.
(Prefix caches and KV events over this engine: test_vllm_backend_prefix.py.)

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
    return [[rng.randrange(0, 500) for _ in range(n)] for n in (5, 63, 64, 65, 130, 17, 200, 31, 250)]


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


K = 3  # top alternatives the logprobs tests ask for
LOGPROB_PROMPTS = (0, 3, 4)  # 5, 65 and 130 tokens
ECHO_TOKENS = 3

# each position of vLLM's logprobs as {token text: [token id, logprob, rank]} (text: the tokenizer's decoding
# of that token alone, as pdserve names it)
REFERENCE = """
import json, sys
from vllm import LLM, SamplingParams
model, prompts, max_tokens, k, lp_prompts, echo_tokens = (sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]),
                                                          int(sys.argv[4]), json.loads(sys.argv[5]), int(sys.argv[6]))
llm = LLM(model=model, dtype="float32", max_model_len=512, block_size=64, enforce_eager=True,
          kv_cache_memory_bytes=64 << 20, seed=0)
tok = llm.get_tokenizer()
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=max_tokens, temperature=0))
print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
def table(pos):
    return None if pos is None else {tok.decode([t]): [t, lp.logprob, lp.rank] for t, lp in pos.items()}
lp_outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in lp_prompts],
                       SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=k))
echo_outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in lp_prompts],
                         SamplingParams(max_tokens=echo_tokens, temperature=0, logprobs=k, prompt_logprobs=k))
print("LOGPROBS " + json.dumps({"sample": [[table(p) for p in o.outputs[0].logprobs] for o in lp_outs],
                                "prompt": [[table(p) for p in o.prompt_logprobs] for o in echo_outs]}))
"""


@pytest.fixture(scope="module")
def colocated(vllm_python, model, tmp_path_factory) -> dict:
    """vLLM colocated (its own LLM class, no pdserve) on the same checkpoint and prompts: the greedy tokens of
    every prompt; for LOGPROB_PROMPTS, the logprobs (top K) of those tokens and of the prompt."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_NO_USAGE_STATS": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([vllm_python, "-c", REFERENCE, str(model), json.dumps(_prompts()), str(MAX_TOKENS), str(K),
                           json.dumps(LOGPROB_PROMPTS), str(ECHO_TOKENS)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path_factory.mktemp("ref"))
    found = {}
    for line in proc.stdout.splitlines():
        tag, _, rest = line.partition(" ")
        if tag in ("RESULT", "LOGPROBS"):
            found[tag] = json.loads(rest)
    assert proc.returncode == 0 and len(found) == 2, proc.stderr[-3000:]
    assert all(len(t) == MAX_TOKENS for t in found["RESULT"])
    return {"tokens": found["RESULT"], **found["LOGPROBS"]}


@pytest.fixture(scope="module")
def reference(colocated) -> list[list[int]]:
    return colocated["tokens"]


def _start_decode(procs: ProcessGroup, model: Path, name: str, transfer: str = "tcp") -> Server:
    grpc_port, http_port, kv_port = free_port(), free_port(), free_port()
    proc = procs.pdserve("decode", "--port", str(grpc_port), "--http-port", str(http_port), "--kv-port", str(kv_port),
                         "--model", str(model), "--transfer", transfer, *ENGINE, name=name,
                         env={"VLLM_CPU_OMP_THREADS_BIND": "1"})
    return Server(proc, http_port, grpc_port, kv_port, name)


def _start_prefill(procs: ProcessGroup, model: Path, decodes: list[Server], name: str, transfer: str = "tcp") -> Server:
    http_port, grpc_port = free_port(), free_port()
    proc = procs.pdserve("prefill", "--port", str(http_port), "--grpc-port", str(grpc_port),
                         "--decode", ",".join(d.grpc_address for d in decodes), "--model", str(model),
                         "--transfer", transfer,
                         "--session-timeout", "10", *ENGINE, name=name,
                         env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    return Server(proc, http_port, grpc_port, 0, name)


def start_ready_pair(procs: ProcessGroup, model: Path) -> tuple[Server, Server]:
    """A decode and a prefill over it (tcp, --engine vllm), both ready: (prefill, decode)."""
    decode = _start_decode(procs, model, "decode")
    prefill = _start_prefill(procs, model, [decode], "prefill")
    wait_ready(decode, START_TIMEOUT)
    wait_ready(prefill, START_TIMEOUT)
    return prefill, decode


@pytest.fixture(scope="module")
def cluster(vllm_python, model, tmp_path_factory):
    with ProcessGroup(tmp_path_factory.mktemp("vllm-pd-logs")) as procs:
        yield start_ready_pair(procs, model)


def _complete(prefill: Server, ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    status, body = post_json(prefill.url + "/v1/completions", {"model": "m", "prompt": _text(ids),
                                                                 "max_tokens": max_tokens, "temperature": 0},
                             timeout=120)
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


def test_stop_strings(cluster, reference):
    """Stop strings are cut by the prefill's text stream (vLLM is not given them)."""
    prefill, decode = cluster
    ids, want = _prompts()[2], reference[2]
    full = _text(want)
    stop = f" t{want[3]}"
    status, body = post_json(prefill.url + "/v1/completions",
                             {"model": "m", "prompt": _text(ids), "max_tokens": MAX_TOKENS,
                                                                 "temperature": 0, "stop": [stop]})
    assert status == 200, body
    assert body["choices"][0]["text"] == full[:full.find(stop)] and body["choices"][0]["finish_reason"] == "stop"
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings


def _events(prefill: Server, path: str, body: dict) -> list[dict]:
    """The data events of a streamed request, read to its end."""
    conn = http.client.HTTPConnection("127.0.0.1", prefill.http_port, timeout=120)
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    events = [json.loads(line[len(b"data: "):]) for line in resp if line.startswith(b"data: {")]
    conn.close()
    return events


def _joined_columns(events: list[dict]) -> dict:
    """/v1/completions' streamed logprobs columns, joined."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    for event in events:
        for choice in event.get("choices", ()):
            for name in out:
                out[name] += (choice.get("logprobs") or {}).get(name) or []
    return out


def _check_columns(lp: dict, want: list[dict], start: int = 0, end: int | None = None, greedy: bool = True) -> None:
    """/v1/completions' logprobs columns [start, end) against vLLM colocated's positions (``want``: {token
    text: [id, logprob, rank]}), within 1e-4; ``greedy`` (generated tokens): the chosen token is the most
    likely of its top K."""
    tokens, chosen, tops = (lp[name][start:end] for name in ("tokens", "token_logprobs", "top_logprobs"))
    assert len(tokens) == len(chosen) == len(tops) == len(want)
    for i, (token, value, top, pos) in enumerate(zip(tokens, chosen, tops, want)):
        assert token in pos and value == pytest.approx(pos[token][1], abs=1e-4), (i, token, value, pos)
        assert set(top) == {t for t, (_, _, rank) in pos.items() if rank <= K}, (i, top, pos)
        assert all(v == pytest.approx(pos[t][1], abs=1e-4) for t, v in top.items()), (i, top, pos)
        if greedy:
            assert value == pytest.approx(max(top.values()), abs=1e-6) and token in top, (i, token, value, top)


def test_logprobs_equal_vllm_colocated(cluster, reference, colocated):
    """/v1/completions with logprobs, whole and streamed: one logprob per generated token (the first
    from the prefill, the rest from the decode), its top K, all equal to vLLM's LLM.generate(logprobs=K)."""
    prefill, decode = cluster
    for n, i in enumerate(LOGPROB_PROMPTS):
        ids, want = _prompts()[i], colocated["sample"][n]
        body = {"model": "m", "prompt": _text(ids), "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": K}
        status, whole = post_json(prefill.url + "/v1/completions", body, timeout=120)
        assert status == 200, whole
        assert _ids(whole["choices"][0]["text"]) == reference[i]
        _check_columns(whole["choices"][0]["logprobs"], want)
        streamed = _joined_columns(_events(prefill, "/v1/completions", body))
        assert _ids(" ".join(streamed["tokens"])) == reference[i]
        _check_columns(streamed, want)
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings


def test_echo_with_logprobs_equals_vllm_colocated(cluster, colocated):
    """echo + logprobs (the prompt's logprobs, computed on the prefill): the first prompt token has none,
    the others and the generated ones equal vLLM's prompt_logprobs / logprobs."""
    prefill, decode = cluster
    for n, i in enumerate(LOGPROB_PROMPTS):
        ids = _prompts()[i]
        status, body = post_json(prefill.url + "/v1/completions", {
            "model": "m", "prompt": _text(ids), "max_tokens": ECHO_TOKENS, "temperature": 0, "logprobs": K,
            "echo": True}, timeout=120)
        assert status == 200, body
        lp = body["choices"][0]["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert colocated["prompt"][n][0] is None
        _check_columns(lp, colocated["prompt"][n][1:], 1, len(ids), greedy=False)
        _check_columns(lp, colocated["sample"][n][:ECHO_TOKENS], len(ids))
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings


def test_chat_logprobs_whole_and_streamed(cluster):
    """/v1/chat/completions with logprobs + top_logprobs: one entry per generated token, K alternatives,
    the chosen one the most likely (greedy); the streamed entries equal the whole response's."""
    prefill, decode = cluster
    body = {"model": "m", "messages": [{"role": "user", "content": _text(_prompts()[3])}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "logprobs": True, "top_logprobs": K}
    status, whole = post_json(prefill.url + "/v1/chat/completions", body, timeout=120)
    assert status == 200, whole
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"] > 1
    assert "".join(e["token"] + " " for e in content).strip() == whole["choices"][0]["message"]["content"].strip()
    for e in content:
        assert len(e["top_logprobs"]) == K and e["token"] == e["top_logprobs"][0]["token"]
        assert e["logprob"] == pytest.approx(max(a["logprob"] for a in e["top_logprobs"]), abs=1e-6)
    streamed = [e for event in _events(prefill, "/v1/chat/completions", body) for choice in event.get("choices", ())
                for e in ((choice.get("logprobs") or {}).get("content") or ())]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-4)
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings


def _start_pair(procs: ProcessGroup, model: Path, transfer: str, tries: int = 3) -> tuple[Server, Server]:
    """A decode and a prefill on it, both ready. Started again on fresh ports when one lost a port free_port
    gave it to another socket before binding it (UCX's ephemeral ports make that likelier with nixl)."""
    for attempt in range(tries):
        decode = _start_decode(procs, model, f"decode-{transfer}-{attempt}", transfer=transfer)
        prefill = _start_prefill(procs, model, [decode], f"prefill-{transfer}-{attempt}", transfer=transfer)
        try:
            wait_ready(decode, START_TIMEOUT)
            wait_ready(prefill, START_TIMEOUT)
            return prefill, decode
        except RuntimeError:  # exited before it was ready
            for server in (decode, prefill):
                procs.kill(server.proc)
            logs = [(procs.log_dir / f"{server.name}.log").read_text(errors="replace") for server in (decode, prefill)]
            if attempt == tries - 1 or not any("address already in use" in log for log in logs):
                raise
    raise AssertionError("unreachable")


def test_nixl_transfer_equals_vllm_colocated(vllm_python, model, reference, tmp_path):
    """The same P/D with the KV moved by the CacheStore's nixl transport (UCX) instead of tcp: a concurrent
    batch's greedy tokens equal vLLM colocated, and everything is released."""
    with ProcessGroup(tmp_path / "logs") as procs:
        prefill, decode = _start_pair(procs, model, "nixl")
        with ThreadPoolExecutor(len(_prompts())) as pool:
            got = list(pool.map(lambda ids: _complete(prefill, ids), _prompts()))
        assert got == reference
        assert _received(decode) > 0  # the prompts' KV came through the CacheStore
        readings = wait_all_released([prefill, decode])
        assert nothing_held(readings), readings
        health = get_json(decode.url + "/health")[1]
        assert health["kv_blocks_free"] == health["kv_blocks_total"] and health["engine_requests"] == 0


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
