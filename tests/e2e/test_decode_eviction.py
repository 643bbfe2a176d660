"""LSO eviction with real processes: a batch request's KV goes to host memory while an
interactive request runs, comes back afterwards, and its greedy output is unchanged.

One prefill and one decode with two SLO classes: ``interactive`` (a TBT target of 1 ms, which
no step meets, so the decode always protects it) and ``batch`` (no TTFT/TBT target: evictable).
- A batch stream alone is never evicted; the same stream with an interactive request arriving
  mid-way is evicted (``pdserve_kv_evictions_total{action="evict"}``) and restored once the
  interactive one ended, and its text is identical to the uncontended run.
- A batch client that disconnects while its request is evicted drops the host copy at once.
Afterwards the decode holds nothing: sessions, KV blocks, CacheStore entries, swapped requests.
"""

import http.client
import json
import threading

import pytest

from harness.pd_cluster import (get_json, metric, nothing_held, post_json, start_decode, start_prefill,
                                wait_all_released, wait_ready)
from harness.procs import ProcessGroup
from harness.router_cluster import wait_until

pytestmark = pytest.mark.slow

CLASSES = json.dumps({"defaultClass": "interactive", "classes": [
    {"name": "interactive", "tbtMs": 1}, {"name": "batch", "e2eMs": 3600000}]})
BATCH_PROMPT = "Write a very long list of fruits and their colours:"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    group = ProcessGroup(log_dir=tmp_path_factory.mktemp("lso") / "logs")
    try:
        decode = start_decode(group, "tcp", 256)
        wait_ready(decode)
        prefill = start_prefill(group, [decode.grpc_address], "tcp", extra=["--slo-classes", CLASSES])
        wait_ready(prefill)
        yield {"decode": decode, "prefill": prefill}
    finally:
        group.close()


def _batch_stream(server, max_tokens):
    """A streamed batch completion: (connection, response, a generator of text deltas)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    body = {"model": "tiny", "prompt": BATCH_PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", "X-SLO-Class": "batch"})
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


def test_evicted_batch_request_resumes_with_identical_output(cluster):
    prefill, decode = cluster["prefill"], cluster["decode"]
    conn, deltas = _batch_stream(prefill, 300)
    alone = "".join(deltas)
    conn.close()
    assert metric(decode.url, "pdserve_kv_evictions_total") == 0  # nothing to protect: never evicted

    conn, deltas = _batch_stream(prefill, 300)
    text = next(deltas)  # the batch request is in the decode's batch
    interactive = {}
    thread = threading.Thread(target=_interactive, args=(prefill, 200, interactive))
    thread.start()
    text += "".join(deltas)
    thread.join()
    conn.close()
    assert interactive["status"] == 200 and interactive["body"]["usage"]["completion_tokens"] == 200, interactive
    assert metric(decode.url, "pdserve_kv_evictions_total", action="evict") >= 1
    assert metric(decode.url, "pdserve_kv_evictions_total", action="restore") == \
        metric(decode.url, "pdserve_kv_evictions_total", action="evict")
    assert text == alone
    readings = wait_all_released([prefill, decode], timeout=20.0)
    assert nothing_held(readings), readings
    assert metric(decode.url, "pdserve_kv_swapped_bytes") == 0


def test_a_batch_client_leaving_while_evicted_drops_its_host_copy(cluster):
    prefill, decode = cluster["prefill"], cluster["decode"]
    conn, deltas = _batch_stream(prefill, 1500)
    next(deltas)
    interactive = {}
    thread = threading.Thread(target=_interactive, args=(prefill, 1000, interactive))
    thread.start()
    try:
        wait_until(lambda: _swapped(decode) == 1, "the batch request evicted", timeout=30)
        conn.sock.close()
        conn.close()
        wait_until(lambda: _swapped(decode) == 0, "the evicted request dropped", timeout=10)
        assert thread.is_alive(), "the interactive request was still running: the check above is valid"
    finally:
        thread.join()
    assert interactive["status"] == 200, interactive
    readings = wait_all_released([prefill, decode], timeout=20.0)
    assert nothing_held(readings), readings
