"""Leases and deadlines with real processes (README "What you can rely on when things fail").

A frozen peer (SIGSTOP: alive, its TCP connections open, silent) is the case only timers
can handle: nothing breaks, nothing is closed. Each test freezes one end and checks that
the other end frees what the request holds within the documented bound (plus slack for a
shared, slow machine), then thaws it and checks that nothing is held on either end.

The end-to-end deadline (--request-timeout, X-Request-Timeout, gRPC deadline) ends a
request with a clear error and frees it on both ends.
"""

import http.client
import json
import os
import signal
import threading
import time

import grpc
import pytest

from harness.pd_cluster import get_json, nothing_held, start_decode, start_prefill, wait_all_released, wait_ready

pytestmark = pytest.mark.slow

SLACK = 8.0  # a shared 2-core machine: bounds are asserted generously, never tightened
SESSION_TIMEOUT = 2.0
RESUME_WAIT = 1.0  # with no other decode: how long the prefill waits for one before the error event


def _sse(prefill, body, headers=None, timeout=120):
    conn = http.client.HTTPConnection("127.0.0.1", prefill.http_port, timeout=timeout)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json", **(headers or {})})
    return conn, conn.getresponse()


def _events(resp):
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: "):
            yield line[6:]


def _post(prefill, body, headers=None, timeout=120):
    conn = http.client.HTTPConnection("127.0.0.1", prefill.http_port, timeout=timeout)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read() or b"{}")
    conn.close()
    return out


def _freeze(server):
    os.killpg(server.proc.pid, signal.SIGSTOP)


def _thaw(server):
    os.killpg(server.proc.pid, signal.SIGCONT)


@pytest.mark.parametrize("decodes", [2, 1], ids=["resumes", "error_event"])
def test_decode_frozen_mid_generation(procs, decodes):
    """The prefill hears nothing from a frozen decode for --session-timeout: it gives up on it
    (resuming on the other decode, or an error event when there is none, after --resume-wait)
    and frees its side; after SIGCONT the decode sees the cancel and frees its side too."""
    servers = [start_decode(procs, name=f"decode{i}") for i in range(decodes)]
    for d in servers:
        wait_ready(d)
    prefill = start_prefill(procs, [d.grpc_address for d in servers],
                            extra=["--session-timeout", str(SESSION_TIMEOUT), "--resume-wait", str(RESUME_WAIT)])
    wait_ready(prefill)
    conn, resp = _sse(prefill, {"model": "tiny", "prompt": "go", "max_tokens": 400, "ignore_eos": True, "temperature": 0})
    assert resp.status == 200
    events = _events(resp)
    for _ in range(3):
        next(events)
    victim = next(d for d in servers if get_json(d.url + "/health")[1]["sessions"] == 1)
    _freeze(victim)
    try:
        t0 = time.monotonic()
        rest = [next(events)]
        stall = time.monotonic() - t0  # until the first event after the freeze (a token or the error)
        rest += list(events)
        conn.close()
        assert stall < SESSION_TIMEOUT + RESUME_WAIT + SLACK, stall
        assert rest[-1] == "[DONE]"
        chunks = [json.loads(e) for e in rest[:-1]]
        errors = [c["error"] for c in chunks if "error" in c]
        if decodes == 2:
            assert not errors, errors
            assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
        else:
            assert errors and errors[0]["code"] == "decode_failed", chunks[-2:]
            assert "sent nothing" in errors[0]["message"] and victim.grpc_address in errors[0]["message"], errors
        alive = [prefill] + [d for d in servers if d is not victim]
        readings = wait_all_released(alive, timeout=SLACK)
        assert nothing_held(readings), readings
    finally:
        _thaw(victim)
    readings = wait_all_released([victim, prefill], timeout=SLACK)
    assert nothing_held(readings), readings


def test_prefill_frozen_after_reservation_decode_frees(procs):
    """A prefill frozen after the decode reserved blocks (before any KV): the decode frees the
    reservation within --session-timeout; after SIGCONT the prefill's client gets an answer
    and neither end holds anything."""
    decode = start_decode(procs, name="decode", extra=["--session-timeout", str(SESSION_TIMEOUT)])
    wait_ready(decode)
    # KV goes only after the whole forward pass, which the prefill starts 30 s after the decode
    # allocated (a test hook): a window, wide on any machine, where the decode has reserved and waits
    prefill = start_prefill(procs, [decode.grpc_address], extra=["--no-layerwise-push"],
                            env={"PDSERVE_TEST_HOLD_AFTER_ALLOCATION_S": "30"})
    wait_ready(prefill)
    total = get_json(decode.url + "/health")[1]["kv_blocks_total"]
    prompt = [256] + [97 + i % 26 for i in range(1999)]
    answer = {}

    def client():
        try:
            answer["status"] = _post(prefill, {"model": "tiny", "prompt": prompt, "max_tokens": 4}, timeout=120)[0]
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            answer["error"] = repr(exc)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while get_json(decode.url + "/health")[1]["session_stages"].get("transfer", 0) == 0:
        assert time.monotonic() < deadline, "the request never reached the transfer stage"
        time.sleep(0.005)
    _freeze(prefill)
    try:
        t0 = time.monotonic()
        held = get_json(decode.url + "/health")[1]
        assert held["sessions"] == 1 and held["kv_blocks_used"] > 0, held
        while True:
            h = get_json(decode.url + "/health")[1]
            if h["sessions"] == 0 and h["kv_blocks_free"] == total:
                break
            # the session bound, plus the 5 s the decode gives a frame cut off mid-way to stop
            assert time.monotonic() - t0 < SESSION_TIMEOUT + 5 + SLACK, h
            time.sleep(0.1)
    finally:
        _thaw(prefill)
    thread.join(60)
    assert not thread.is_alive() and "error" not in answer, answer
    assert answer["status"] in (502, 503, 504), answer
    readings = wait_all_released([decode, prefill], timeout=SLACK + SESSION_TIMEOUT)
    assert nothing_held(readings), readings


def test_request_timeout_header_flag_and_grpc_deadline(procs):
    from pdserve.protos import generate_pb2 as gpb
    from pdserve.protos import generate_pb2_grpc as gpb_grpc

    decode = start_decode(procs, name="decode")
    wait_ready(decode)
    prefill = start_prefill(procs, [decode.grpc_address], extra=["--request-timeout", "3"])
    wait_ready(prefill)
    long_gen = {"model": "tiny", "prompt": "go", "max_tokens": 2000, "ignore_eos": True}

    # streamed: tokens, then the timeout as an error event, then [DONE]
    t0 = time.monotonic()
    conn, resp = _sse(prefill, long_gen, {"X-Request-Timeout": "1"})
    assert resp.status == 200
    rest = list(_events(resp))
    elapsed = time.monotonic() - t0
    conn.close()
    assert rest[-1] == "[DONE]"
    chunks = [json.loads(e) for e in rest[:-1]]
    assert any(c.get("choices") for c in chunks), "no token before the deadline"
    assert chunks[-1]["error"]["code"] == "request_timeout" and "1s" in chunks[-1]["error"]["message"], chunks[-1]
    assert 0.9 < elapsed < 1 + SLACK, elapsed
    readings = wait_all_released([prefill, decode], timeout=SLACK)
    assert nothing_held(readings), readings

    # nothing streamed yet (a long prompt, a deadline shorter than its prefill): 504
    prompt = [256] + [97 + i % 26 for i in range(1999)]
    status, body = _post(prefill, {"model": "tiny", "prompt": prompt, "max_tokens": 4}, {"X-Request-Timeout": "0.05"})
    assert status == 504 and body["error"]["code"] == "request_timeout", body
    readings = wait_all_released([prefill, decode], timeout=SLACK)
    assert nothing_held(readings), readings

    # no header: the server's --request-timeout (3 s); a larger header is capped by it
    t0 = time.monotonic()
    status, body = _post(prefill, long_gen, {"X-Request-Timeout": "1000"})
    assert status == 504 and "3s" in body["error"]["message"], body
    assert 2.9 < time.monotonic() - t0 < 3 + SLACK
    readings = wait_all_released([prefill, decode], timeout=SLACK)
    assert nothing_held(readings), readings

    # gRPC: the client's deadline
    with grpc.insecure_channel(prefill.grpc_address) as ch:
        got = []
        with pytest.raises(grpc.RpcError) as info:
            for r in gpb_grpc.GeneratorStub(ch).Generate(gpb.GenerateRequest(prompt="go", max_tokens=2000, ignore_eos=True),
                                                         timeout=1.0):
                got.append(r)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert got, "no token before the deadline"
    readings = wait_all_released([prefill, decode], timeout=SLACK)
    assert nothing_held(readings), readings

    # bad values: 400 naming the header, nothing started
    for bad in ("abc", "0", "-1", "nan", "inf", ""):
        status, body = _post(prefill, long_gen, {"X-Request-Timeout": bad})
        assert status == 400 and body["error"]["param"] == "X-Request-Timeout", (bad, body)
        assert "X-Request-Timeout" in body["error"]["message"]
    readings = wait_all_released([prefill, decode], timeout=SLACK)
    assert nothing_held(readings), readings


def test_a_request_may_outlast_the_queue_timeout(procs):
    """--queue-timeout bounds only the wait for KV blocks; it once also became the Session's gRPC
    deadline, so every request running longer than it (10 s by default) died mid-stream."""
    decode = start_decode(procs, num_blocks=256)
    prefill = start_prefill(procs, [decode.grpc_address], extra=["--queue-timeout", "1", "--no-resume"])
    wait_ready(decode), wait_ready(prefill)
    started = time.monotonic()
    conn, resp = _sse(prefill, {"model": "tiny", "prompt": "long", "max_tokens": 1500, "ignore_eos": True,
                                "temperature": 0})
    events = list(_events(resp))
    conn.close()
    assert time.monotonic() - started > 1.5, "the stream was too short to prove anything"
    assert not any(e.startswith('{"error"') for e in events), events[-3:]
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert nothing_held(wait_all_released([prefill, decode]))
