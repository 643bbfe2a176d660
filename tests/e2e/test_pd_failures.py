"""Failure semantics with real processes (DESIGN.md "Failure semantics").

Decode killed mid-generation: with another decode the request resumes there (prompt +
tokens so far are prefilled again; greedy output is unchanged), also when that decode starts
reporting only after the kill (the request waits for it, --resume-wait); with none, the
client stream ends with an error event after --resume-wait.

Each test ends by checking that KV blocks, Sessions and CacheStore entries are back to
zero on every process still alive.
"""

import http.client
import json
import subprocess
import sys
import time

import grpc
import pytest

from harness.pd_cluster import (get_json, metric, nothing_held, post_json, start_decode, start_prefill,
                                wait_all_released, wait_ready)
from pdserve.net import free_port
from harness.conditions import wait_until
from harness.procs import wait_for_port

pytestmark = pytest.mark.slow

LONG_PROMPT = [256] + [65 + i % 26 for i in range(149)]  # 150 tokens: 3 blocks with max_tokens 8
# the streams a test cuts (its decode killed, its client gone) last >= 2000 x this on any CPU (a test hook), so
# they are still running when a starved test process gets to cut them; it costs nothing (they are cut)
CUT_STREAM_STEP_FLOOR_S = 0.005
RELEASE_HANG_GUARD_S = 20.0  # only a hang guard on a release (less than the 30 s session timeout of the first test)


def _generate_grpc(prefill, **fields):
    from pdserve.protos import generate_pb2 as gpb
    from pdserve.protos import generate_pb2_grpc as gpb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{prefill.grpc_port}") as ch:
        return list(gpb_grpc.GeneratorStub(ch).Generate(gpb.GenerateRequest(**fields), timeout=60))


def test_refused_then_next_decode_then_413(procs):
    small = start_decode(procs, num_blocks=2, name="small")
    big = start_decode(procs, num_blocks=64, name="big")
    for d in (small, big):
        wait_ready(d)
    prefill = start_prefill(procs, [small.grpc_address, big.grpc_address], extra=["--policy", "rr"])
    wait_ready(prefill)
    for _ in range(2):  # round robin: one of the two goes to `small` first, which refuses
        status, body = post_json(prefill.url + "/v1/completions",
                                 {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 8, "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 8, body
    assert metric(small.url, "pdserve_kv_allocation_refusals_total", reason="too_large") >= 1
    assert metric(prefill.url, "pdserve_decode_retries_total", reason="too_large") >= 1

    procs.kill(big.proc)
    deadline = time.monotonic() + 10  # until big's last load report expires
    while big.grpc_address in get_json(prefill.url + "/health")[1]["routable_decodes"] and time.monotonic() < deadline:
        time.sleep(0.1)
    # the only decode left can never hold it (3 blocks, 2 in all): 413 at once, not a wait
    status, body = post_json(prefill.url + "/v1/completions", {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 8})
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    assert "holds only 2 KV blocks in all" in body["error"]["message"], body
    with pytest.raises(grpc.RpcError) as info:
        _generate_grpc(prefill, prompt_token_ids=LONG_PROMPT, max_tokens=8)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "2 KV blocks in all" in info.value.details()
    readings = wait_all_released([prefill, small])
    assert nothing_held(readings), readings


def test_unreachable_decode_is_skipped(procs):
    a = start_decode(procs, name="a")
    b = start_decode(procs, name="b")
    for d in (a, b):
        wait_ready(d)
    # a long expiry keeps the dead decode "routable" so requests really hit it
    prefill = start_prefill(procs, [a.grpc_address, b.grpc_address],
                            extra=["--policy", "rr", "--load-report-expiry", "60"])
    wait_ready(prefill)
    procs.kill(a.proc)
    for _ in range(3):
        status, body = post_json(prefill.url + "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 4})
        assert status == 200, body
    assert metric(prefill.url, "pdserve_decode_retries_total", reason="decode_unreachable") >= 1
    readings = wait_all_released([prefill, b])
    assert nothing_held(readings), readings


@pytest.mark.parametrize("policy", ["rr", "wrr"])
def test_local_fallback_when_no_decode_can_take_it(procs, policy):
    small = start_decode(procs, num_blocks=2, name="small")
    wait_ready(small)
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    prefill = start_prefill(procs, [small.grpc_address, dead], extra=["--local-fallback", "--policy", policy])
    wait_ready(prefill)
    status, body = post_json(prefill.url + "/v1/completions",
                             {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 8, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 8, body
    assert metric(prefill.url, "pdserve_local_fallbacks_total") == 1
    # rr asks the small decode, which refuses; wrr knows from its load report that it is too small
    refusals = metric(small.url, "pdserve_kv_allocation_refusals_total", reason="too_large")
    assert refusals == (1 if policy == "rr" else 0)
    # a short prompt still goes through the decode
    status, body = post_json(prefill.url + "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4})
    assert status == 200 and metric(prefill.url, "pdserve_local_fallbacks_total") == 1
    readings = wait_all_released([prefill, small])
    assert nothing_held(readings), readings


def test_ready_false_without_decodes_unless_fallback(procs):
    dead = f"127.0.0.1:{free_port()}"
    plain = start_prefill(procs, [dead], name="plain")
    fallback = start_prefill(procs, [dead], extra=["--local-fallback"], name="fallback")
    wait_ready(fallback)
    wait_for_port(plain.http_port, proc=plain.proc)
    status, body = get_json(plain.url + "/ready")
    assert status == 503 and body["ready"] is False and "no decode" in body["reason"]
    status, body = post_json(plain.url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert status == 503 and body["error"]["code"] == "no_decode_available"


def _sse_request(prefill, body):
    conn = http.client.HTTPConnection("127.0.0.1", prefill.http_port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def _events(resp):
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: "):
            yield line[6:]


def test_decode_killed_mid_generation_gives_error_event(procs):
    decode = start_decode(procs, name="decode", step_floor_s=CUT_STREAM_STEP_FLOOR_S)
    wait_ready(decode)
    prefill = start_prefill(procs, [decode.grpc_address], extra=["--resume-wait", "1"])
    wait_ready(prefill)
    conn, resp = _sse_request(prefill, {"model": "tiny", "prompt": "go", "max_tokens": 2000, "ignore_eos": True})
    events = _events(resp)
    for _ in range(3):
        next(events)
    procs.kill(decode.proc)
    rest = list(events)
    conn.close()
    assert rest[-1] == "[DONE]"
    errors = [json.loads(e)["error"] for e in rest[:-1] if e.startswith('{"error"')]
    assert errors and errors[0]["code"] == "decode_failed" and decode.grpc_address in errors[0]["message"], rest[-3:]
    assert "for one (--resume-wait 1s)" in errors[0]["message"], errors  # it waited for another decode first
    readings = wait_all_released([prefill])
    assert nothing_held(readings), readings


def _session_client_script(address: str, timeout_s: float) -> str:
    """A stand-in prefill process: Start, read the Allocation, print it, then hang (to be killed)."""
    return f"""
import sys, time, grpc
from pdserve.protos import session_pb2 as pb, session_pb2_grpc as pbg
from pdserve.protos.version import PROTOCOL_VERSION
import queue
q = queue.Queue()
def requests():
    yield pb.PrefillMessage(start=pb.Start(request_id="victim", prompt_token_ids=list(range(1, 130)),
        sampling=pb.Sampling(max_tokens=8, top_p=1.0), blocks_needed=3, protocol_version=PROTOCOL_VERSION,
        timeout_s={timeout_s}, compat=pb.Compat(dtype="float32", num_layers=4, num_kv_heads=2, head_dim=16,
        block_size=64, model="tiny", transport="tcp")))
    q.get()
ch = grpc.insecure_channel("{address}")
for msg in pbg.DecodeStub(ch).Session(requests()):
    print(msg.WhichOneof("kind"), flush=True)
    time.sleep(3600)
"""


def _ended(decode, outcome: str, reason: str) -> float:
    """Sessions the decode ended with this (outcome, reason): why it freed a request."""
    return metric(decode.url, "pdserve_requests_total", outcome=outcome, reason=reason)


def test_prefill_killed_or_hung_mid_transfer_decode_frees(procs):
    decode = start_decode(procs, name="decode", extra=["--session-timeout", "30"])
    wait_ready(decode)
    # killed: the stream breaks, decode frees at once: for the broken stream (prefill_gone), long
    # before its 30 s timeout could have done it
    fake = subprocess.Popen([sys.executable, "-c", _session_client_script(decode.grpc_address, 30)],
                            stdout=subprocess.PIPE, start_new_session=True)
    procs.procs.append(fake)
    assert fake.stdout.readline().strip() == b"allocation"
    held = get_json(decode.url + "/health")[1]
    assert held["sessions"] == 1 and held["kv_blocks_used"] >= 3 and held["cachestore"]["pinned_entries"] == 1
    procs.kill(fake)
    readings = wait_all_released([decode], timeout=RELEASE_HANG_GUARD_S)
    assert nothing_held(readings), readings
    assert _ended(decode, "cancelled", "prefill_gone") == 1 and _ended(decode, "error", "timeout") == 0
    # hung: the stream stays open, nothing arrives; decode frees after the session timeout (2 s):
    # it held the request until then (a session, its blocks), and the timeout is what ended it
    fake = subprocess.Popen([sys.executable, "-c", _session_client_script(decode.grpc_address, 2)],
                            stdout=subprocess.PIPE, start_new_session=True)
    procs.procs.append(fake)
    assert fake.stdout.readline().strip() == b"allocation"
    held = get_json(decode.url + "/health")[1]
    assert held["sessions"] == 1 and held["kv_blocks_used"] >= 3, held
    readings = wait_all_released([decode], timeout=RELEASE_HANG_GUARD_S)
    assert nothing_held(readings), readings
    assert _ended(decode, "error", "timeout") == 1 and _ended(decode, "cancelled", "prefill_gone") == 1
    assert fake.poll() is None  # the stand-in prefill still holds its stream open: only the timeout freed it
    procs.kill(fake)


def test_real_prefill_killed_mid_transfer_decode_frees(procs):
    decode = start_decode(procs, name="decode")
    wait_ready(decode)
    prefill = start_prefill(procs, [decode.grpc_address])
    wait_ready(prefill)
    prompt = [256] + [97 + i % 26 for i in range(1999)]  # ~0.3 s of layer-by-layer prefill on tiny
    client = subprocess.Popen([sys.executable, "-c", f"""
import json, urllib.request
req = urllib.request.Request("{prefill.url}/v1/completions", json.dumps({{"model": "tiny", "prompt": {prompt}, "max_tokens": 4}}).encode(),
                             {{"Content-Type": "application/json"}})
try:
    urllib.request.urlopen(req, timeout=60).read()
except Exception:
    pass
"""], start_new_session=True)  # noqa: E501
    procs.procs.append(client)
    deadline = time.monotonic() + 30
    while get_json(decode.url + "/health")[1]["session_stages"].get("transfer", 0) == 0:
        assert time.monotonic() < deadline, "the request never reached the transfer stage"
        time.sleep(0.005)
    procs.kill(prefill.proc)  # mid-transfer: decode has allocated and is receiving layers
    readings = wait_all_released([decode], timeout=5)
    assert nothing_held(readings), readings
    assert get_json(decode.url + "/health")[1]["kv_blocks_free"] == 64


def test_real_prefill_killed_while_its_decode_generates_decode_stops_and_frees(procs):
    """No orphaned work: the KV has moved and the decode is generating for a prefill that relays its
    tokens; the prefill dies; the decode stops that request at once (the Session stream broke:
    cancelled, prefill_gone) and frees its blocks, Session and CacheStore entry. Its steps last
    >= 50 ms (test hook), so the 2000-token stream would take >= 100 s: a release within the 20 s
    hang guard is the decode stopping, not finishing."""
    decode = start_decode(procs, name="decode", step_floor_s=0.05)
    wait_ready(decode)
    prefill = start_prefill(procs, [decode.grpc_address])
    wait_ready(prefill)
    client = subprocess.Popen([sys.executable, "-c", f"""
import json, urllib.request
body = {{"model": "tiny", "prompt": "tell me a long story", "max_tokens": 2000, "ignore_eos": True, "stream": True}}
req = urllib.request.Request("{prefill.url}/v1/completions", json.dumps(body).encode(), {{"Content-Type": "application/json"}})
try:
    with urllib.request.urlopen(req, timeout=300) as resp:
        for line in resp:
            print(line.decode().strip(), flush=True)
except Exception:
    pass
"""], stdout=subprocess.PIPE, start_new_session=True)  # noqa: E501
    procs.procs.append(client)
    for _ in range(3):  # three tokens reached the client: the decode is generating, the prefill relaying
        assert client.stdout.readline().startswith(b"data:"), "the stream ended before it started"
        client.stdout.readline()  # the blank line after each SSE event
    assert get_json(decode.url + "/health")[1]["session_stages"].get("decode") == 1
    procs.kill(prefill.proc)
    readings = wait_all_released([decode], timeout=RELEASE_HANG_GUARD_S)
    assert nothing_held(readings), readings
    assert _ended(decode, "cancelled", "prefill_gone") == 1
    assert get_json(decode.url + "/health")[1]["kv_blocks_free"] == 64


def test_incompatible_peer_is_refused_naming_both_values(procs):
    from pdserve.protos import session_pb2 as pb
    from pdserve.protos import session_pb2_grpc as pbg
    from pdserve.protos.version import PROTOCOL_VERSION

    decode = start_decode(procs, name="decode")
    wait_ready(decode)
    start = pb.Start(request_id="x", prompt_token_ids=[1, 2, 3], sampling=pb.Sampling(max_tokens=2, top_p=1.0),
                     blocks_needed=1, protocol_version=PROTOCOL_VERSION, timeout_s=5,
                     compat=pb.Compat(dtype="float16", num_layers=4, num_kv_heads=2, head_dim=16, block_size=64,
                                      model="tiny", transport="tcp"))
    with grpc.insecure_channel(decode.grpc_address) as ch:
        replies = list(pbg.DecodeStub(ch).Session(iter([pb.PrefillMessage(start=start)]), timeout=10))
        assert replies[0].refusal.code == "incompatible"
        assert "dtype: prefill='float16' decode='float32'" in replies[0].refusal.reason
        start.protocol_version = PROTOCOL_VERSION + 1
        replies = list(pbg.DecodeStub(ch).Session(iter([pb.PrefillMessage(start=start)]), timeout=10))
        assert replies[0].refusal.code == "version"
    readings = wait_all_released([decode])
    assert nothing_held(readings), readings


def test_client_disconnect_cancels_on_decode(procs):
    """A client that goes away mid-stream cancels its request on the prefill and on the decode (the
    session ends as cancelled, not by running its 2000 tokens to the end), and everything is freed."""
    decode = start_decode(procs, name="decode", step_floor_s=CUT_STREAM_STEP_FLOOR_S)
    wait_ready(decode)
    prefill = start_prefill(procs, [decode.grpc_address])
    wait_ready(prefill)

    def assert_cancelled_everywhere(n: int) -> None:
        readings = wait_all_released([decode, prefill], timeout=RELEASE_HANG_GUARD_S)
        assert nothing_held(readings), readings
        assert metric(prefill.url, "pdserve_requests_total", outcome="cancelled") == n
        assert _ended(decode, "cancelled", "prefill_gone") == n
        assert metric(decode.url, "pdserve_requests_total", outcome="ok") == 0  # none ran to its end

    # HTTP: close the connection mid-stream
    conn, resp = _sse_request(prefill, {"model": "tiny", "prompt": "go", "max_tokens": 2000, "ignore_eos": True})
    events = _events(resp)
    for _ in range(3):
        next(events)
    assert get_json(decode.url + "/health")[1]["sessions"] == 1
    conn.sock.shutdown(2)
    conn.close()
    assert_cancelled_everywhere(1)
    # gRPC: cancel the call mid-stream
    from pdserve.protos import generate_pb2 as gpb
    from pdserve.protos import generate_pb2_grpc as gpb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{prefill.grpc_port}") as ch:
        call = gpb_grpc.GeneratorStub(ch).Generate(gpb.GenerateRequest(prompt="go", max_tokens=2000, ignore_eos=True),
                                                   timeout=60)
        next(call), next(call)
        call.cancel()
        assert_cancelled_everywhere(2)


def _greedy_reference(prompt, max_tokens):
    import torch

    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, load_model

    torch.set_num_threads(1)
    engine = LLMEngine(load_model("tiny"), EngineConfig(num_blocks=64))
    engine.add_request("ref", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    expected = []
    while engine.has_unfinished():
        for out in engine.step():
            expected += out.new_token_ids
    return expected


def _stream_through(prefill, prompt: list[int], max_tokens: int, after_three, timeout: float):
    """Greedy Generate on the prefill's gRPC API: read 3 responses, call ``after_three()`` (a decode
    dies there), then read the rest; (every token, the finish reason, what ``after_three`` returned)."""
    from pdserve.protos import generate_pb2 as gpb
    from pdserve.protos import generate_pb2_grpc as gpb_grpc

    got, finish = [], ""
    with grpc.insecure_channel(f"127.0.0.1:{prefill.grpc_port}") as ch:
        call = gpb_grpc.GeneratorStub(ch).Generate(
            gpb.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True),
            timeout=timeout)
        for _ in range(3):
            got += next(call).token_ids
        result = after_three()
        for resp in call:
            got += resp.token_ids
            finish = resp.finish_reason or finish
    return got, finish, result


def test_decode_killed_mid_generation_resumes_on_another_decode(procs):
    decodes = [start_decode(procs, num_blocks=64, name=f"decode{i}") for i in range(2)]
    for d in decodes:
        wait_ready(d)
    prefill = start_prefill(procs, [d.grpc_address for d in decodes])
    wait_ready(prefill)
    prompt, max_tokens = [256, *b"resume me"], 1000

    def kill_the_busy_decode():
        victim = next(d for d in decodes if get_json(d.url + "/health")[1]["sessions"] == 1)
        procs.kill(victim.proc)
        return victim

    got, finish, victim = _stream_through(prefill, prompt, max_tokens, kill_the_busy_decode, timeout=120)
    assert finish == "length" and len(got) == max_tokens
    assert metric(prefill.url, "pdserve_decode_retries_total", reason="decode_failed") == 1
    assert got == _greedy_reference(prompt, max_tokens)
    survivor = next(d for d in decodes if d is not victim)
    readings = wait_all_released([prefill, survivor])
    assert nothing_held(readings), readings


def test_decode_killed_before_the_other_decode_reported_resumes_there(procs):
    """The prefill lists two decodes but only one runs: the other starts after the first is
    killed mid-stream, so the prefill has no load report from it then (seen 1 run in 5 with two
    decodes started together). The request waits for it instead of ending with decode_failed."""
    first = start_decode(procs, num_blocks=64, name="decode0")
    later_port = free_port()
    wait_ready(first)
    # the second decode's start on this busy machine must fit in the wait
    prefill = start_prefill(procs, [first.grpc_address, f"127.0.0.1:{later_port}"], extra=["--resume-wait", "100"])
    wait_ready(prefill)
    prompt, max_tokens = [256, *b"resume later"], 1000

    def kill_it_then_start_the_other():
        assert get_json(first.url + "/health")[1]["sessions"] == 1
        procs.kill(first.proc)
        return start_decode(procs, num_blocks=64, name="decode1", grpc_port=later_port)

    got, finish, later = _stream_through(prefill, prompt, max_tokens, kill_it_then_start_the_other, timeout=180)
    assert finish == "length" and len(got) == max_tokens
    assert metric(prefill.url, "pdserve_decode_retries_total", reason="decode_failed") == 1
    assert got == _greedy_reference(prompt, max_tokens)
    readings = wait_all_released([prefill, later])
    assert nothing_held(readings), readings


def test_a_finished_request_counts_as_served_when_its_prefill_closes_first(procs, tmp_path):
    """The prefill closes the Session as soon as the decode's Finish reaches it; a decode still closing its own
    engine stream then (held there by a test hook) counts the request served, not cancelled by a gone prefill."""
    from harness.gates import Gate
    from pdserve.test_hooks import DECODE_FINISH_GATE_ENV

    gate = Gate(tmp_path / "finish-gate")  # never opened: the prefill's close ends the hold
    decode = start_decode(procs, env={DECODE_FINISH_GATE_ENV: str(gate.directory)})
    wait_ready(decode)
    prefill = start_prefill(procs, [decode.grpc_address])
    wait_ready(prefill)
    status, body = post_json(prefill.url + "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 4,
                                                               "temperature": 0, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body
    readings = wait_all_released([prefill, decode], RELEASE_HANG_GUARD_S)
    assert nothing_held(readings), readings
    # the decode counts the request when its session's handler ends, which can come after the blocks are free
    wait_until(lambda: metric(decode.url, "pdserve_requests_total") >= 1, "the decode counting the request")
    assert metric(decode.url, "pdserve_requests_total", outcome="ok", reason="length") == 1
    assert metric(decode.url, "pdserve_requests_total", outcome="cancelled", reason="prefill_gone") == 0
