"""The global SLO queue in the router (router/slo_gate.py), with real processes.

One decode that holds one request at a time, one prefill in front of it that holds each decode
reservation before computing until the test opens a gate (a test hook), and two routers over that
prefill: ``edf`` and ``fifo``, with the classes ``interactive`` (a TTFT target) and ``batch``. Four
batch requests, then one interactive, through each router: behind the edf router the interactive
one overtakes the batch requests still waiting in the router's line; behind the fifo router it is
served last. A request whose deadline passes in the router's line gets 504 naming that queue;
an unknown class gets the router's own 400. Afterwards nothing is held anywhere.

Every request's place (held at the gate, in the prefill's queue, in the router's line) is waited
for before the next one is sent; the gate opens once all of them are in place.
"""

import json
import threading

import pytest

from harness.gates import Gate
from harness.pd_cluster import (get_json, nothing_held, post_json, start_decode, start_prefill, wait_all_released,
                                wait_ready)
from harness.procs import ProcessGroup
from harness.router_cluster import start_router, wait_until

pytestmark = pytest.mark.slow

CLASSES = json.dumps({"defaultClass": "batch", "classes": [
    {"name": "interactive", "ttftMs": 5000}, {"name": "batch", "e2eMs": 3600000}]})
HANG_GUARD_S = 60.0  # only a hang guard: each wait below is for an event that comes within a second or two


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    group = ProcessGroup(log_dir=tmp_path_factory.mktemp("router-slo") / "logs")
    gate = Gate(tmp_path_factory.mktemp("gate"))
    try:
        decode = start_decode(group, "tcp", 4)  # 4 blocks of 64 tokens: one request (100 + 60 tokens) at a time
        wait_ready(decode)
        # --load-report-expiry: the decode never stops answering here. On a starved CPU one late load report
        # can make the prefill see no decode and fail the request waiting in its queue, so that it reports
        # an empty queue and the router lets the timed request through (the likely cause of this test's one
        # CI failure: the timed request timed out in the prefill's queue instead of the router's line)
        prefill = start_prefill(group, [decode.grpc_address], "tcp", env=gate.env,
                                extra=["--slo-classes", CLASSES, "--load-report-expiry", "60"])
        wait_ready(prefill)
        routers = {policy: start_router(group, [prefill], name=f"router-{policy}",
                                        extra=["--slo-classes", CLASSES, "--queue-policy", policy])
                   for policy in ("edf", "fifo")}
        for r in routers.values():
            wait_ready(r)
        yield {"decode": decode, "prefill": prefill, "gate": gate, **routers}
    finally:
        gate.open()
        group.close()


def _body(i):
    return {"model": "tiny", "prompt": [256] + [65 + (i + k) % 26 for k in range(99)], "max_tokens": 60,
            "ignore_eos": True, "temperature": 0}


def _queued(router) -> int:
    return get_json(router.url + "/health")[1]["queued"]


def _second_waits_in_the_prefill(router) -> bool:
    """The router last heard the prefill report two requests in flight, one of them in its admission
    queue: the first held at the gate (after its decode's allocation), the second waiting for blocks.
    (``queued == 1`` alone is not that state: right after the previous test, the prefill may still see
    the decode full from an old load report and queue the FIRST request for a moment.)"""
    (state,) = get_json(router.url + "/health")[1]["prefills"].values()
    load = state["load"] or {}
    return load.get("queued", 0) == 1 and load.get("in_flight", 0) == 2


def _burst(router, gate, prefill) -> list[str]:
    """Four batch requests, then an interactive one once two batch requests wait in the router's
    line; the order in which the router let them go, as the prefill saw them arrive (its SLO
    records: the clients' own finish order is not it on a starved CPU, where a client thread may
    wake long after its answer came)."""
    answers, lock = {}, threading.Lock()

    def send(name, headers):
        status, body = post_json(router.url + "/v1/completions", _body(len(name)), timeout=120, headers=headers)
        with lock:
            answers[name] = (status, body)

    threads = []

    def batch(i):
        threads.append(threading.Thread(target=send, args=(f"batch{i}", {"X-SLO-Class": "batch"})))
        threads[-1].start()

    # batch0 holds the decode (held at the gate), batch1 waits in the prefill's own line (and the
    # router has heard so): from then on the router holds requests in its line, in its policy's order
    gate.close()
    try:
        batch(0)
        gate.wait_held(1)
        batch(1)
        wait_until(lambda: _second_waits_in_the_prefill(router), "batch1 in the prefill's queue, as the router hears",
                   timeout=HANG_GUARD_S)
        for i in (2, 3):  # in this order
            batch(i)
            wait_until(lambda: _queued(router) == i - 1, f"batch{i} waiting in the router", timeout=HANG_GUARD_S)
        threads.append(threading.Thread(target=send, args=("interactive", {"X-SLO-Class": "interactive"})))
        threads[-1].start()
        wait_until(lambda: _queued(router) == 3, "the interactive request waiting in the router", timeout=HANG_GUARD_S)
        assert len(gate.held()) == 1  # batch0 still holds the decode: nothing has moved yet
    finally:
        gate.open()
        for t in threads:
            t.join()
    assert sorted(answers) == ["batch0", "batch1", "batch2", "batch3", "interactive"], answers
    assert all(status == 200 for status, _ in answers.values()), answers
    records = {r["request_id"]: r for r in get_json(prefill.url + "/debug/slo?recent=64")[1]["recent"]}
    arrival = {name: records[body["id"].removeprefix("cmpl-")]["arrival"] for name, (_, body) in answers.items()}
    return sorted(arrival, key=arrival.get)


def test_edf_lets_the_interactive_request_overtake_and_fifo_does_not(cluster):
    edf = _burst(cluster["edf"], cluster["gate"], cluster["prefill"])
    assert edf.index("interactive") < edf.index("batch3") and edf.index("interactive") < 4, edf
    fifo = _burst(cluster["fifo"], cluster["gate"], cluster["prefill"])
    assert fifo[-1] == "interactive", fifo
    readings = wait_all_released([cluster["prefill"], cluster["decode"]], timeout=20.0)
    assert nothing_held(readings), readings
    assert _queued(cluster["edf"]) == 0 and _queued(cluster["fifo"]) == 0


def test_deadline_in_the_router_queue_and_unknown_class(cluster):
    router, gate = cluster["edf"], cluster["gate"]
    status, body = post_json(router.url + "/v1/completions", _body(0), headers={"X-SLO-Class": "gold"})
    assert status == 400 and body["error"]["code"] == "unknown_slo_class", body
    assert "interactive" in body["error"]["message"] and "batch" in body["error"]["message"]
    # one blocker holds the decode (at the gate), the other waits in the prefill's queue, and the router
    # has heard so: the next request waits in the router's line until its deadline
    outcomes: dict[int, tuple] = {}

    def block(i):
        outcomes[i] = post_json(router.url + "/v1/completions", _body(i), timeout=120)

    blockers = [threading.Thread(target=block, args=(i,)) for i in range(2)]
    gate.close()
    try:
        blockers[0].start()
        gate.wait_held(1)
        blockers[1].start()
        wait_until(lambda: _second_waits_in_the_prefill(router), "the second blocker in the prefill's queue, "
                   "as the router hears", timeout=HANG_GUARD_S)
        status, body = post_json(router.url + "/v1/completions", _body(5), headers={"X-Request-Timeout": "0.5"})
        assert status == 504 and body["error"]["code"] == "request_timeout", body
        assert "router's SLO queue" in body["error"]["message"], body
    finally:
        gate.open()
        for t in blockers:
            if t.ident is not None:  # started
                t.join()
    # both blockers were served: neither left the prefill's queue early (which would have let the
    # timed request through the router's line)
    assert [outcomes[i][0] for i in sorted(outcomes)] == [200, 200], outcomes
    readings = wait_all_released([cluster["prefill"], cluster["decode"]], timeout=20.0)
    assert nothing_held(readings), readings
    assert _queued(router) == 0
