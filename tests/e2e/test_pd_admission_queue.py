"""A full decode is a reason to wait, not to fail (prefill's admission queue), with real processes.

One decode with a KV pool of 4 blocks (256 tokens) and two prefills in front of it:
- ``plain``: more concurrent requests than the decode holds at once all succeed (none is
  refused), the queue gauge went above zero, and afterwards the queue, KV blocks,
  Sessions and CacheStore entries are back to zero; a request larger than the decode's
  whole pool gets 413 at once, not a wait;
- ``held`` (holds each decode reservation before computing until the test opens a gate, a
  test hook, and lets one request wait): a request whose deadline passes in the queue gets 504
  naming the queue, one more gets 429 while the queue is full, a client that disconnects
  while queued leaves the queue at once; nothing is left behind.
"""

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.gates import Gate
from harness.pd_cluster import (get_json, metric, nothing_held, post_json, start_decode, start_prefill,
                                wait_all_released, wait_ready)
from harness.procs import ProcessGroup

pytestmark = pytest.mark.slow

DECODE_BLOCKS = 4  # of 64 tokens
HANG_GUARD_S = 60.0  # only a hang guard: each wait below is for an event that comes within a second or two


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    group = ProcessGroup(log_dir=tmp_path_factory.mktemp("queue") / "logs")
    gate = Gate(tmp_path_factory.mktemp("gate"))  # the `held` prefill's requests wait there after their Allocation
    try:
        decode = start_decode(group, "tcp", DECODE_BLOCKS)
        wait_ready(decode)
        plain = start_prefill(group, [decode.grpc_address], "tcp", name="plain")
        held = start_prefill(group, [decode.grpc_address], "tcp", name="held", extra=["--max-queued-requests", "1"],
                             env=gate.env)
        for p in (plain, held):
            wait_ready(p)
        yield {"decode": decode, "plain": plain, "held": held, "gate": gate}
    finally:
        gate.open()
        group.close()


def _until(predicate, what, timeout=HANG_GUARD_S):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"hang guard: not within {timeout}s: {what}")
        time.sleep(0.02)


def _queued(server) -> int:
    return get_json(server.url + "/health")[1]["queued"]


def _body(n_prompt, max_tokens, **extra):
    return {"model": "tiny", "prompt": [256] + [65 + i % 26 for i in range(n_prompt - 1)], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, **extra}


def test_more_requests_than_fit_all_wait_and_succeed(cluster):
    plain, decode = cluster["plain"], cluster["decode"]
    # 100 prompt + 60 new tokens = 3 of the decode's 4 blocks: one request at a time fits
    n = 8
    seen_queued, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            seen_queued.append(metric(plain.url, "pdserve_requests_queued"))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(n) as pool:
            results = list(pool.map(lambda i: post_json(plain.url + "/v1/completions", _body(100, 60), timeout=120),
                                    range(n)))
    finally:
        stop.set()
        watcher.join()
    assert [status for status, _ in results] == [200] * n, [b for s, b in results if s != 200]
    assert all(body["usage"]["completion_tokens"] == 60 for _, body in results)
    assert max(seen_queued) > 0, "the queue gauge never went above zero"
    assert metric(plain.url, "pdserve_queue_wait_seconds_count") >= n
    assert metric(plain.url, "pdserve_requests_total", reason="no_decode") == 0
    readings = wait_all_released([plain, decode], timeout=20.0)
    assert nothing_held(readings), readings
    assert metric(plain.url, "pdserve_requests_queued") == 0


def test_a_request_that_can_never_fit_gets_413_at_once(cluster):
    plain, decode = cluster["plain"], cluster["decode"]
    # "at once": a request that waited in the queue would end only at its deadline (600 s by default), as a
    # 504, after this client (HANG_GUARD_S) gave up
    status, body = post_json(plain.url + "/v1/completions", _body(300, 10), timeout=HANG_GUARD_S)  # 5 blocks > 4
    assert status == 413, body
    assert body["error"]["code"] == "request_too_large"
    assert "5 KV blocks" in body["error"]["message"] and "4 KV blocks in all" in body["error"]["message"], body
    assert metric(plain.url, "pdserve_requests_total", reason="too_large") == 1
    readings = wait_all_released([plain, decode])
    assert nothing_held(readings), readings


def _stream(server, body, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json", **(headers or {})})
    return conn


def test_deadline_queue_full_and_disconnect_while_queued(cluster):
    held, decode, gate = cluster["held"], cluster["decode"], cluster["gate"]
    # the blocker takes the decode's whole pool and holds it at the gate, before it even computes
    gate.close()
    blocker = {}
    thread = threading.Thread(target=lambda: blocker.update(zip(("status", "body"), post_json(
        held.url + "/v1/completions", _body(10, 240), timeout=120))))
    thread.start()
    try:
        # the blocker itself may have waited in line (held's view of the decode can still be the last
        # test's full pool): once it is held at the gate it has left the queue, and a queued count of 1
        # means the next request
        (blocker_id,) = gate.wait_held(1)
        assert get_json(decode.url + "/health")[1]["sessions"] == 1 and _queued(held) == 0
        late = {}
        waiter = threading.Thread(target=lambda: late.update(zip(("status", "body"), _timed(held))))
        waiter.start()
        _until(lambda: _queued(held) == 1, "the second request queued")
        # the queue (at most 1) is full: one more is refused at once, with its own code
        status, body = post_json(held.url + "/v1/completions", _body(10, 10))
        assert status == 429 and body["error"]["code"] == "queue_full", body
        waiter.join()
        assert late["status"] == 504, late
        err = late["body"]["error"]
        assert err["code"] == "request_timeout" and "admission queue" in err["message"], err
        assert _queued(held) == 0
        # a client that disconnects while queued leaves the queue at once (its deadline is 600 s away)
        conn = _stream(held, _body(10, 10))
        _until(lambda: _queued(held) == 1, "the third request queued")
        conn.sock.close()
        conn.close()
        _until(lambda: _queued(held) == 0, "the disconnected request leaving the queue")
        # the blocker held the decode's whole pool all along: the checks above are valid
        assert gate.held() == [blocker_id] and thread.is_alive()
        assert get_json(decode.url + "/health")[1]["sessions"] == 1
    finally:
        gate.open()
        thread.join()
    assert blocker["status"] == 200 and blocker["body"]["usage"]["completion_tokens"] == 240, blocker
    readings = wait_all_released([held, decode], timeout=20.0)
    assert nothing_held(readings), readings
    assert metric(held.url, "pdserve_requests_total", reason="queue_full") == 1
    assert metric(held.url, "pdserve_requests_total", reason="timeout") == 1


def _timed(server):
    """A request with a 1 s deadline (X-Request-Timeout) while the decode is full."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(_body(10, 10)),
                 {"Content-Type": "application/json", "X-Request-Timeout": "1.0"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read() or b"{}")
    conn.close()
    return out
