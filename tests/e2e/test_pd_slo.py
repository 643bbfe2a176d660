"""SLO classes and the global queue over real processes: one prefill (``--slo-classes``,
``--queue-policy edf``) and one decode whose KV pool holds two long requests at once.

- a request picks its class by the header X-SLO-Class, by vLLM's body field priority, or
  gets the default class; the per-class metrics count it;
- an unknown class (header, priority, gRPC metadata) is a 400 / INVALID_ARGUMENT naming
  the known classes;
- while the decode is full, an interactive request (early rejection on) whose TTFT target
  cannot be met even if it were served next gets 429 at once with Retry-After and the
  estimate in the message;
- queued behind batch requests, an interactive request (no early rejection) goes first;
- a client that disconnects while queued leaves the queue at once;
- after every test nothing is queued, running or held on either process.

The running requests of the queueing tests are held at the decode's gate (harness/decode_gate.py)
until the test has seen what it needs, so none can end (and let a waiting one in) however fast
the CPU decodes or however slowly the test runs. A held stream is silent: the prefill's
--session-timeout (which would fail it and resume it, freeing its blocks) is only a hang guard here.
"""

import asyncio
import json
import time
import urllib.request

import aiohttp
import grpc
import pytest

from harness.decode_gate import DecodeGate
from harness.pd_cluster import (get_json, metric, nothing_held, start_decode, start_prefill,
                                wait_all_released, wait_ready)
from harness.procs import ProcessGroup

pytestmark = pytest.mark.slow

CLASSES = {"ttftMs": 60000, "classes": [
    {"name": "interactive", "ttftMs": 100, "e2eMs": 60000, "earlyReject": True, "priority": -1},
    {"name": "chat", "ttftMs": 2000, "e2eMs": 60000, "priority": 2},
    {"name": "batch", "e2eMs": 600000, "priority": 1}]}
# prompt 10 + max_tokens 300 -> 5 blocks of 64 on the decode: 10 blocks hold two such requests
LONG = 300
HELD_S = 600  # the prefill's --session-timeout: longer than any wait of a test on a held stream (a hang guard)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    group = ProcessGroup(log_dir=tmp_path_factory.mktemp("pd-slo") / "logs")
    gate = DecodeGate(tmp_path_factory.mktemp("pd-slo-gate"), opened=True)
    try:
        with pytest.MonkeyPatch.context() as mp:  # the decode only (start_decode passes our environment on)
            for name, value in gate.env.items():
                mp.setenv(name, value)
            decode = start_decode(group, "tcp", num_blocks=10, name="decode")
        wait_ready(decode)
        prefill = start_prefill(group, [decode.grpc_address], "tcp", 64, name="prefill", extra=[
            "--slo-classes", json.dumps(CLASSES), "--queue-policy", "edf", "--queue-timeout", "60",
            "--load-report-interval", "0.1", "--session-timeout", str(HELD_S)])
        wait_ready(prefill)
        yield prefill, decode, gate
    finally:
        gate.open()
        group.close()


@pytest.fixture
def servers(cluster):
    prefill, decode, gate = cluster
    yield prefill, decode
    gate.open()
    readings = wait_all_released([prefill, decode], timeout=30.0)
    assert nothing_held(readings), readings
    health = get_json(prefill.url + "/health")[1]
    assert health["queued"] == 0 and health["slo_running"] == 0, health


def body(max_tokens=4, **extra):
    return {"model": "tiny", "prompt": "hello there", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **extra}


def post(url, payload, headers=None, timeout=120):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read() or b"{}")


def recent(prefill, response: dict) -> dict:
    """The SLO queue's record of the request that got this response."""
    request_id = response["id"].removeprefix("cmpl-")
    return next(r for r in get_json(prefill.url + "/debug/slo")[1]["recent"] if r["request_id"] == request_id)


def test_class_by_header_priority_or_default(servers):
    prefill, _ = servers
    for rid, headers, extra, cls in [("by-header", {"X-SLO-Class": "batch"}, {}, "batch"),
                                     ("by-priority", {}, {"priority": 2}, "chat"),
                                     ("by-both", {"X-SLO-Class": "batch"}, {"priority": 1}, "batch"),
                                     ("priority-0", {}, {"priority": 0}, "default"),
                                     ("by-default", {}, {}, "default")]:
        before = metric(prefill.url, "pdserve_slo_requests_total", slo_class=cls, outcome="ok")
        status, _, out = post(prefill.url, body(**extra), headers)
        assert status == 200, (rid, out)
        assert recent(prefill, out)["slo_class"] == cls, rid
        assert metric(prefill.url, "pdserve_slo_requests_total", slo_class=cls, outcome="ok") == before + 1
    assert metric(prefill.url, "pdserve_slo_attainment_total", slo_class="chat", target="all") >= 1
    assert metric(prefill.url, "pdserve_slo_queue_time_seconds_count", slo_class="batch") >= 2


@pytest.mark.parametrize("headers, extra, words", [
    ({"X-SLO-Class": "gold"}, {}, "unknown SLO class 'gold' in header X-SLO-Class"),
    ({}, {"priority": 7}, "no SLO class answers priority 7"),
    ({}, {"priority": "high"}, "priority must be an integer"),
    ({"X-SLO-Class": "chat"}, {"priority": 1}, "header X-SLO-Class says 'chat' but priority 1 selects 'batch'"),
])
def test_an_unknown_class_is_a_400_naming_the_known_ones(servers, headers, extra, words):
    prefill, _ = servers
    status, _, out = post(prefill.url, body(**extra), headers)
    assert status == 400, out
    err = out["error"]
    assert words in err["message"] and err["code"] == "unknown_slo_class"
    for known in ("default", "interactive (priority -1)", "chat (priority 2)", "batch (priority 1)"):
        assert known in err["message"]


def test_grpc_class_from_metadata(servers):
    from pdserve.protos import generate_pb2 as gpb
    from pdserve.protos import generate_pb2_grpc as gpb_grpc

    prefill, _ = servers
    with grpc.insecure_channel(prefill.grpc_address) as channel:
        stub = gpb_grpc.GeneratorStub(channel)
        req = gpb.GenerateRequest(prompt="hi", max_tokens=3, ignore_eos=True, request_id="grpc-batch")
        assert sum(len(r.token_ids) for r in stub.Generate(req, metadata=[("x-slo-class", "batch")], timeout=60)) == 3
        assert recent(prefill, {"id": "grpc-batch"})["slo_class"] == "batch"
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(gpb.GenerateRequest(prompt="hi", max_tokens=3), metadata=[("x-slo-class", "gold")],
                               timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown SLO class 'gold'" in err.value.details() and "interactive" in err.value.details()


async def _send(session, url, payload, headers=None):
    async with session.post(url + "/v1/completions", json=payload, headers=headers or {}) as resp:
        return resp.status, dict(resp.headers), await resp.json(), time.monotonic()


async def _until(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


def queued(prefill) -> int:
    return get_json(prefill.url + "/health")[1]["queued"]


def test_full_decode_early_rejection_and_edf_order(servers, cluster):
    """Four long batch requests: two run, two wait. An interactive request (TTFT 100 ms,
    early rejection) cannot be served within its target even next: 429 at once. A chat
    request (TTFT 2 s, no early rejection) queues behind the two waiting batch requests and
    is admitted before them (edf)."""
    prefill, _ = servers
    # warm the estimator: prefill time, time per token, output lengths
    for i in range(2):
        assert post(prefill.url, body(LONG), {"X-SLO-Class": "batch"})[0] == 200

    gate = cluster[2]
    gate.close()  # the two that run hold the decode's blocks until the chat request has queued

    async def scenario():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
            batch = [asyncio.create_task(_send(session, prefill.url, body(LONG),
                                               {"X-SLO-Class": "batch"})) for i in range(4)]
            await _until(lambda: queued(prefill) == 2 and len(gate.held()) == 2)
            rejected = await _send(session, prefill.url, body(8), {"X-SLO-Class": "interactive"})
            # at once, not after a wait: answered while nothing had changed (no batch request had ended
            # to make room; the two behind the running ones still waited)
            no_batch_ended = not any(b.done() for b in batch)
            queued_then = queued(prefill)
            chat = asyncio.create_task(_send(session, prefill.url, body(8, priority=2)))
            await _until(lambda: queued(prefill) == 3)
            gate.open()
            return rejected, (no_batch_ended, queued_then), await chat, await asyncio.gather(*batch)

    (status, headers, out, _), (no_batch_ended, queued_then), chat, batch = asyncio.run(scenario())
    assert status == 429, out
    assert no_batch_ended and queued_then == 2, (no_batch_ended, queued_then)
    assert int(headers["Retry-After"]) >= 1
    msg = out["error"]["message"]
    assert out["error"]["code"] == "slo_cannot_be_met"
    assert "SLO class 'interactive' cannot be met even if this request were served next" in msg
    assert "estimated wait" in msg and "(target 100 ms)" in msg and "2 waiting, 2 running" in msg, msg
    assert chat[0] == 200 and all(b[0] == 200 for b in batch), (chat, batch)
    # edf: the chat request (deadline: arrival + 2 s) left the queue before the batch requests
    # that were waiting when it came (deadline: arrival + 600 s)
    recs = {"chat-0": recent(prefill, chat[2])} | {f"batch-{i}": recent(prefill, b[2]) for i, b in enumerate(batch)}
    queued_batch = sorted((r for r in recs if r != "chat-0"), key=lambda r: recs[r]["admitted"])[-2:]
    assert all(recs[b]["arrival"] < recs["chat-0"]["arrival"] for b in queued_batch), recs
    assert all(recs["chat-0"]["admitted"] < recs[b]["admitted"] for b in queued_batch), recs
    assert recs["chat-0"]["estimate"]["wait"] > 0  # it was told it would wait
    assert metric(prefill.url, "pdserve_slo_requests_total", slo_class="interactive", outcome="rejected") >= 1


def test_a_client_that_disconnects_while_queued_leaves_at_once(servers, cluster):
    prefill, _ = servers
    gate = cluster[2]
    gate.close()  # the two batch requests hold the decode until the leaver has left
    cancelled = metric(prefill.url, "pdserve_slo_requests_total", slo_class="batch", outcome="cancelled")

    async def scenario():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
            batch = [asyncio.create_task(_send(session, prefill.url, body(LONG),
                                               {"X-SLO-Class": "batch"})) for i in range(2)]
            await _until(lambda: get_json(prefill.url + "/health")[1]["slo_running"] == 2 and len(gate.held()) == 2)
            leaver = asyncio.create_task(_send(session, prefill.url, body(8),
                                               {"X-SLO-Class": "batch"}))
            await _until(lambda: queued(prefill) == 1)
            leaver.cancel()  # the client goes away: its connection closes
            await _until(lambda: queued(prefill) == 0)
            # it left because it went away, not because a slot opened: both batch requests still run
            still_running = not any(b.done() for b in batch)
            gate.open()
            return still_running, await asyncio.gather(*batch)

    still_running, batch = asyncio.run(scenario())
    assert still_running, "the queue emptied only once a batch request had ended"
    assert all(b[0] == 200 for b in batch)
    assert metric(prefill.url, "pdserve_slo_requests_total", slo_class="batch", outcome="cancelled") == cancelled + 1


def test_through_the_router_the_class_header_reaches_the_prefill(servers, procs):
    """``pdserve router`` forwards X-SLO-Class and relays the prefill's answer (and its
    Retry-After) unchanged."""
    from pdserve.net import free_port
    from pdserve.router.http_api import _headers

    from harness.pd_cluster import Server

    prefill, _ = servers
    port = free_port()
    proc = procs.pdserve("router", "--port", str(port), "--model", "tiny", "--prefill", prefill.grpc_address,
                         "--load-interval", "0.1", name="router")
    router = Server(proc, port, 0, 0, "router")
    wait_ready(router)
    status, _, out = post(router.url, body(), {"X-SLO-Class": "batch"})
    assert status == 200, out
    assert recent(prefill, out)["slo_class"] == "batch"
    status, _, out = post(router.url, body(), {"X-SLO-Class": "gold"})
    assert status == 400 and "unknown SLO class 'gold'" in out["error"]["message"], out

    class Upstream:
        headers = {"Content-Type": "application/json", "Retry-After": "3", "X-Other": "no"}
    assert _headers(Upstream) == {"Content-Type": "application/json", "Retry-After": "3"}
