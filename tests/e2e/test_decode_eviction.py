"""LSO eviction with real processes: a batch request's KV goes to host memory while an
interactive request runs, comes back afterwards, and its greedy output is unchanged.

One prefill and one decode with two SLO classes: ``interactive`` (a TBT target of 1 ms, which
no step meets, so the decode always protects it) and ``batch`` (no TTFT/TBT target: evictable).
- A batch stream alone is never evicted; the same stream sharing the decode's batch with an
  interactive request is evicted (``pdserve_kv_evictions_total{action="evict"}``) and restored
  once the interactive one ended, and its text is identical to the uncontended run.
- A batch client that disconnects while its request is evicted drops the host copy at once.
Afterwards the decode holds nothing: sessions, KV blocks, CacheStore entries, swapped requests.

Nothing here depends on how fast or loaded the CPU is:
- the two requests overlap by construction: the decode runs behind a test gate
  (harness/decode_gate.py) that the test closes, so both are held with their blocks reserved
  (first token sent, nothing decoded) until both are there; then it opens and they join the
  batch together;
- the interactive target is missed by construction: a test hook (``TEST_STEP_FLOOR_ENV``,
  decode_server/lso.py) makes every decode step last at least ``STEP_FLOOR_S``, three times the
  1 ms target (the tiny model's decode step measures about 1 ms on an idle 2-core box, less on
  a faster CPU: without the floor the eviction depends on the CPU being slow enough). It also
  sets how long the interactive request decodes: the window in which the batch client leaves.
"""

import http.client
import json
import threading

import pytest

from harness.conditions import wait_until
from harness.decode_gate import DecodeGate
from harness.pd_cluster import (get_json, metric, nothing_held, post_json, start_decode, start_prefill,
                                wait_all_released, wait_ready)
from harness.procs import ProcessGroup
from pdserve.test_hooks import DECODE_STEP_FLOOR_ENV as TEST_STEP_FLOOR_ENV

pytestmark = pytest.mark.slow

HANG_GUARD_S = 60.0  # only a hang guard: each wait below takes well under a second on an idle box
STEP_FLOOR_S = 0.003  # every decode step lasts at least this (test hook): 3x the interactive TBT target
CLASSES = json.dumps({"defaultClass": "interactive", "classes": [
    {"name": "interactive", "tbtMs": 1}, {"name": "batch", "e2eMs": 3600000}]})
BATCH_PROMPT = "Write a very long list of fruits and their colours:"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lso")
    gate = DecodeGate(tmp / "decode-gate", opened=True)
    group = ProcessGroup(log_dir=tmp / "logs")
    try:
        with pytest.MonkeyPatch.context() as mp:  # the decode only (start_decode passes our environment on)
            for name, value in (gate.env | {TEST_STEP_FLOOR_ENV: str(STEP_FLOOR_S)}).items():
                mp.setenv(name, value)
            decode = start_decode(group, "tcp", 256)
        wait_ready(decode)
        prefill = start_prefill(group, [decode.grpc_address], "tcp", extra=["--slo-classes", CLASSES])
        wait_ready(prefill)
        yield {"decode": decode, "prefill": prefill, "gate": gate}
    finally:
        gate.open()
        group.close()


@pytest.fixture(autouse=True)
def _gate_opened_afterwards(cluster):
    """A test that fails with the gate closed leaves it open for the next one."""
    yield
    cluster["gate"].open()


def _batch_stream(server, max_tokens):
    """A streamed batch completion: (connection, a generator of text deltas)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    body = {"model": "tiny", "prompt": BATCH_PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json", "X-SLO-Class": "batch"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()

    def deltas():
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            yield json.loads(line[6:])["choices"][0]["text"]
    return conn, deltas()


def _interactive(server, max_tokens, out):
    out.update(zip(("status", "body"), post_json(server.url + "/v1/completions", {
        "model": "tiny", "prompt": "Quick question: what is tea?", "max_tokens": max_tokens, "ignore_eos": True,
        "temperature": 0}, timeout=120)))


def _swapped(decode) -> int:
    return get_json(decode.url + "/health")[1]["swapped_requests"]


def _evictions(decode) -> dict[str, float]:
    return {action: metric(decode.url, "pdserve_kv_evictions_total", action=action) for action in ("evict", "restore")}


def _batch_and_interactive_held(cluster, batch_tokens, interactive_tokens, interactive):
    """Behind the closed gate: a batch stream, then an interactive request, both held at the decode
    (blocks reserved, first token sent); returns the batch stream and the interactive's thread. The
    caller opens the gate: both join the batch together."""
    prefill, gate = cluster["prefill"], cluster["gate"]
    gate.close()
    conn, deltas = _batch_stream(prefill, batch_tokens)
    text = next(deltas)  # the first token, from prefill
    gate.wait_held(1, HANG_GUARD_S)
    thread = threading.Thread(target=_interactive, args=(prefill, interactive_tokens, interactive))
    thread.start()
    gate.wait_held(2, HANG_GUARD_S)
    return conn, text, deltas, thread


def test_evicted_batch_request_resumes_with_identical_output(cluster):
    prefill, decode, gate = cluster["prefill"], cluster["decode"], cluster["gate"]
    before = _evictions(decode)
    conn, deltas = _batch_stream(prefill, 300)
    alone = "".join(deltas)
    conn.close()
    assert _evictions(decode) == before  # nothing to protect: never evicted

    interactive = {}
    conn, text, deltas, thread = _batch_and_interactive_held(cluster, 300, 200, interactive)
    gate.open()  # both join the batch: the interactive one's TBT target is missed, the batch one is evicted
    text += "".join(deltas)  # it ends only after its restore (the interactive one ended first)
    thread.join()
    conn.close()
    assert interactive["status"] == 200 and interactive["body"]["usage"]["completion_tokens"] == 200, interactive
    after = _evictions(decode)
    assert after["evict"] - before["evict"] >= 1
    assert after["restore"] - before["restore"] == after["evict"] - before["evict"]
    assert text == alone
    readings = wait_all_released([prefill, decode], timeout=HANG_GUARD_S)
    assert nothing_held(readings), readings
    assert metric(decode.url, "pdserve_kv_swapped_bytes") == 0


def test_a_batch_client_leaving_while_evicted_drops_its_host_copy(cluster):
    prefill, decode, gate = cluster["prefill"], cluster["decode"], cluster["gate"]
    interactive = {}
    conn, _, _, thread = _batch_and_interactive_held(cluster, 1500, 1000, interactive)  # >= 3 s of decoding
    try:
        before = _evictions(decode)
        gate.open()
        wait_until(lambda: _swapped(decode) == 1, "the batch request evicted", HANG_GUARD_S)
        conn.sock.close()
        conn.close()
        wait_until(lambda: _swapped(decode) == 0, "the evicted request's host copy gone", HANG_GUARD_S)
        after = _evictions(decode)
        # gone because its client left, not restored (the interactive request still ran: the premise held)
        assert after == {"evict": before["evict"] + 1, "restore": before["restore"]}, (before, after)
    finally:
        thread.join()
    assert interactive["status"] == 200, interactive
    readings = wait_all_released([prefill, decode], timeout=HANG_GUARD_S)
    assert nothing_held(readings), readings
