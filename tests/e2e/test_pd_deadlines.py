"""Leases and deadlines with real processes (README "What you can rely on when things fail").

A frozen peer (SIGSTOP: alive, its TCP connections open, silent) is the case only timers
can handle: nothing breaks, nothing is closed. Each test freezes one end and checks that
the other end frees what the request holds within the documented bound (plus slack for a
shared, slow machine), then thaws it and checks that nothing is held on either end.

The end-to-end deadline (--request-timeout, X-Request-Timeout, gRPC deadline) ends a
request with a clear error and frees it on both ends.

A request the test must catch between the decode's Allocation and the prefill's forward pass is
held there by a gate the test opens (harness/gates.py), never by a fixed time.
"""

import http.client
import json
import os
import signal
import threading
import time

import grpc
import pytest

from harness.conditions import wait_until
from harness.gates import Gate
from harness.pd_cluster import (get_json, metric, nothing_held, start_decode, start_prefill, wait_all_released,
                                wait_ready)
from pdserve.test_hooks import DECODE_STEP_FLOOR_ENV as TEST_STEP_FLOOR_ENV
from pdserve.prefill_server.decode_session import DEADLINE_SLACK_S

pytestmark = pytest.mark.slow

SLACK = 8.0  # a shared 2-core machine: bounds are asserted generously, never tightened
SESSION_TIMEOUT = 2.0
RESUME_WAIT = 1.0  # with no other decode: how long the prefill waits for one before the error event
HANG_GUARD_S = 60.0  # only a hang guard for the waits on an event below
STEP_FLOOR_S = 0.025  # test_decode_frozen_mid_generation: 400 decode steps last >= 10 s


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
    # the decodes' steps last at least STEP_FLOOR_S (a test hook): the 400-token stream lasts >= 10 s on any
    # CPU, so the decode holding it is still generating when the test has read 3 events and freezes it (on a
    # fast CPU it had finished before a starved test process got there)
    with pytest.MonkeyPatch.context() as mp:  # the decodes only (start_decode passes our environment on)
        mp.setenv(TEST_STEP_FLOOR_ENV, str(STEP_FLOOR_S))
        servers = [start_decode(procs, name=f"decode{i}") for i in range(decodes)]
    for d in servers:
        wait_ready(d)
    prefill = start_prefill(procs, [d.grpc_address for d in servers],
                            extra=["--session-timeout", str(SESSION_TIMEOUT), "--resume-wait", str(RESUME_WAIT)])
    wait_ready(prefill)
    conn, resp = _sse(prefill,
                      {"model": "tiny", "prompt": "go", "max_tokens": 400, "ignore_eos": True, "temperature": 0})
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


def test_prefill_frozen_after_reservation_decode_frees(procs, tmp_path):
    """A prefill frozen after the decode reserved blocks (before any KV): the decode frees the
    reservation within --session-timeout; after SIGCONT the prefill's client gets an answer
    and neither end holds anything."""
    decode = start_decode(procs, name="decode", extra=["--session-timeout", str(SESSION_TIMEOUT)])
    wait_ready(decode)
    # the prefill holds the request after the decode allocated, before its forward pass (a test
    # hook), until the gate opens: the decode has reserved and waits for KV that has not left
    gate = Gate(tmp_path / "gate")
    prefill = start_prefill(procs, [decode.grpc_address], extra=["--no-layerwise-push"], env=gate.env)
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
    gate.wait_held(1)
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
        gate.open()  # the thawed prefill goes on with a Session the decode has already dropped
        _thaw(prefill)
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive() and "error" not in answer, answer
    assert answer["status"] in (502, 503, 504), answer
    readings = wait_all_released([decode, prefill], timeout=SLACK + SESSION_TIMEOUT)
    assert nothing_held(readings), readings


def test_request_timeout_header_flag_and_grpc_deadline(procs, tmp_path):
    from pdserve.protos import generate_pb2 as gpb
    from pdserve.protos import generate_pb2_grpc as gpb_grpc

    decode = start_decode(procs, name="decode")
    wait_ready(decode)
    # a request outlives its deadline on any machine: held at the gate (closed) before its first
    # token, or its decode frozen (SIGSTOP) after its first token
    gate = Gate(tmp_path / "gate", opened=True)
    prefill = start_prefill(procs, [decode.grpc_address], extra=["--request-timeout", "3"], env=gate.env)
    wait_ready(prefill)
    long_gen = {"model": "tiny", "prompt": "go", "max_tokens": 2000, "ignore_eos": True}

    # streamed: tokens, then the timeout as an error event, then [DONE]
    t0 = time.monotonic()
    conn, resp = _sse(prefill, long_gen, {"X-Request-Timeout": "1"})
    assert resp.status == 200
    events = _events(resp)
    rest = [next(events)]
    _freeze(decode)
    try:
        rest += list(events)
        elapsed = time.monotonic() - t0
    finally:
        _thaw(decode)
    conn.close()
    assert rest[-1] == "[DONE]"
    chunks = [json.loads(e) for e in rest[:-1]]
    assert any(c.get("choices") for c in chunks), "no token before the deadline"
    assert chunks[-1]["error"]["code"] == "request_timeout" and "1s" in chunks[-1]["error"]["message"], chunks[-1]
    assert 0.9 < elapsed < 1 + SLACK, elapsed
    readings = wait_all_released([prefill, decode], timeout=SLACK)
    assert nothing_held(readings), readings

    # nothing streamed yet (the gate holds it before its forward pass until its deadline): 504
    gate.close()
    status, body = _post(prefill, {"model": "tiny", "prompt": "go", "max_tokens": 4}, {"X-Request-Timeout": "0.5"})
    gate.open()
    assert status == 504 and body["error"]["code"] == "request_timeout", body
    readings = wait_all_released([prefill, decode], timeout=SLACK)
    assert nothing_held(readings), readings

    # no header: the server's --request-timeout (3 s); a larger header is capped by it
    gate.close()
    t0 = time.monotonic()
    status, body = _post(prefill, long_gen, {"X-Request-Timeout": "1000"})
    gate.open()
    assert status == 504 and "3s" in body["error"]["message"], body
    assert 2.9 < time.monotonic() - t0 < 3 + SLACK
    readings = wait_all_released([prefill, decode], timeout=SLACK)
    assert nothing_held(readings), readings

    # gRPC: the client's deadline
    with grpc.insecure_channel(prefill.grpc_address) as ch:
        got = []
        try:
            with pytest.raises(grpc.RpcError) as info:
                for r in gpb_grpc.GeneratorStub(ch).Generate(gpb.GenerateRequest(prompt="go", max_tokens=2000,
                                                                                  ignore_eos=True), timeout=1.0):
                    got.append(r)
                    if len(got) == 1:
                        _freeze(decode)
        finally:
            _thaw(decode)
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


def test_a_request_may_outlast_the_queue_timeout(procs, tmp_path):
    """--queue-timeout bounds only the wait for KV blocks; it once also became the Session's gRPC
    deadline, so every request running longer than it (10 s by default) died mid-stream."""
    queue_timeout = 0.5
    decode = start_decode(procs, num_blocks=256)
    gate = Gate(tmp_path / "gate")
    prefill = start_prefill(procs, [decode.grpc_address], extra=["--queue-timeout", str(queue_timeout), "--no-resume"],
                            env=gate.env)
    wait_ready(decode), wait_ready(prefill)
    conn = http.client.HTTPConnection("127.0.0.1", prefill.http_port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "long", "max_tokens": 50,
                                                        "ignore_eos": True, "temperature": 0, "stream": True}),
                 {"Content-Type": "application/json"})
    gate.wait_held(1)  # its Session is open on the decode
    # the condition under test is the Session's age, not an event: it outlives --queue-timeout (and
    # the slack a gRPC deadline gets) while held, however fast this machine computes
    time.sleep(queue_timeout + DEADLINE_SLACK_S + 0.5)
    gate.open()
    events = list(_events(conn.getresponse()))  # the response begins with the first token
    conn.close()
    assert not any(e.startswith('{"error"') for e in events), events[-3:]
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    # that one Session served it (a Session cut off by a deadline would have been retried). The decode
    # counts a Session when it ends, which may come just after the client's last event: wait for it
    wait_until(lambda: metric(decode.url, "pdserve_requests_total") >= 1, "the decode to count the Session",
               HANG_GUARD_S)
    assert (metric(decode.url, "pdserve_requests_total")
            == metric(decode.url, "pdserve_requests_total", outcome="ok") == 1)
    assert nothing_held(wait_all_released([prefill, decode]))
