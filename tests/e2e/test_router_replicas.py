"""Two routers over the same prefills, with real processes, real gRPC and HTTP.

- Two routers that read the same KV events decide the same: after a warm-up of conversations
  (sent through both), every probe prompt gets the same prefill, reason and ranking from each
  (``POST /debug/route``, the decision without the relay).
- A router restarted on the same port rebuilds its index from the prefills' snapshots: once
  it is ready and synced its index holds what the other router's does, and it decides the same.
- gRPC Generate through the router gives the tokens the prefill gives directly; bad input gets
  the prefill's own INVALID_ARGUMENT; a client that cancels mid-stream cancels the prefill's
  request; afterwards nothing is held (KV blocks, Sessions, CacheStore entries, relays).
"""

import grpc
import pytest

from harness.pd_cluster import Server, get_json, metric, nothing_held, post_json, wait_all_released, wait_ready
from harness.procs import ProcessGroup
from harness.router_cluster import start_prefills, start_router, wait_until
from pdserve.net import free_ports
from pdserve.protos import generate_pb2 as gpb
from pdserve.protos import generate_pb2_grpc as gpb_grpc

pytestmark = pytest.mark.slow

BS = 16
EXTRA = ("--block-size", str(BS))
SYSTEMS = ["You are a careful assistant. " * 8, "Answer in French, briefly. " * 8, "Think step by step first. " * 8]


def synced(router: Server, prefills: list[Server]) -> bool:
    state = get_json(router.url + "/health")[1]["prefills"]
    return all(state[p.grpc_address]["routable"] and (state[p.grpc_address]["index"] or {}).get("synced")
               for p in prefills)


def index_sizes(router: Server) -> dict:
    return {a: p["index"]["blocks"] for a, p in get_json(router.url + "/health")[1]["prefills"].items()}


def loads(router: Server) -> dict:
    """What the router last heard of each prefill's load (a balance decision turns on it)."""
    return {a: ((p["load"] or {}).get("in_flight"), (p["load"] or {}).get("kv_blocks_free"), p["in_flight_here"])
            for a, p in get_json(router.url + "/health")[1]["prefills"].items()}


def settled_loads(prefills: list[Server]) -> dict:
    """Each prefill's load as it reports it itself (GetLoad reads the same counters as /health)."""
    out = {}
    for p in prefills:
        health = get_json(p.url + "/health")[1]
        out[p.grpc_address] = (health["in_flight"], health["kv_blocks_free"], 0)  # 0: no relay in flight
    return out


def same_settled_loads(a: Server, b: Server, prefills: list[Server]) -> None:
    """Wait until the prefills hold nothing and each router's view of every prefill's load is the load
    the prefill reports now.

    Two routers agreeing with each other is not enough: the prefill's last release can land between two
    polls, and then one router updates before the other (seen in CI as a different balance pick for an
    unseen prompt). Once both hold the settled load itself, no later poll can change either view.
    """
    assert nothing_held(wait_all_released(prefills))
    wait_until(lambda: loads(a) == settled_loads(prefills) == loads(b),
               "both routers to hear the prefills' settled loads", timeout=15)


def chat(system: str, user: str, max_tokens: int = 4) -> dict:
    return {"model": "tiny", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": max_tokens, "temperature": 0}


def decision(router: Server, body: dict) -> dict:
    status, out = post_json(router.url + "/debug/route?kind=chat", body)
    assert status == 200, out
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    group = ProcessGroup(log_dir=tmp_path_factory.mktemp("routers") / "logs")
    try:
        decode, prefills = start_prefills(group, 2, EXTRA)
        ports = free_ports(4)
        routers = [start_router(group, prefills, ports[2 * i], ports[2 * i + 1], f"router{i}") for i in range(2)]
        for r in routers:
            wait_ready(r)
            wait_until(lambda r=r: synced(r, prefills), f"{r.name} synced")
        yield {"group": group, "decode": decode, "prefills": prefills, "routers": routers}
    finally:
        group.close()


def test_two_routers_agree_and_a_restarted_router_catches_up(cluster):
    group, prefills = cluster["group"], cluster["prefills"]
    a, b = cluster["routers"]
    for i, system in enumerate(SYSTEMS):  # warm-up: each conversation through one router or the other
        status, out = post_json((a if i % 2 else b).url + "/v1/chat/completions", chat(system, "hello"))
        assert status == 200, out
    wait_until(lambda: index_sizes(a) == index_sizes(b), "both indexes to hold the same blocks", timeout=10)
    assert sum(index_sizes(a).values()) > 0
    # the same loads too: a router polls them every interval, so one can still hold a view from mid-warm-up
    same_settled_loads(a, b, prefills)
    probes = [chat(s, f"question {j}") for s in SYSTEMS for j in range(3)] + [chat("unseen system prompt " * 6, "x")]
    seen = [decision(a, p) for p in probes]
    assert seen == [decision(b, p) for p in probes]
    assert {d["reason"] for d in seen[:-1]} == {"prefix"} and seen[-1]["reason"] == "balance"
    assert len({d["prefill"] for d in seen}) == 2, "the warm-up conversations landed on one prefill only"

    # restart router a on the same ports: from the prefills' snapshots it knows what b knows
    group.kill(a.proc)
    a2 = start_router(group, prefills, a.http_port, a.grpc_port, "router0-restarted")
    wait_ready(a2)
    wait_until(lambda: synced(a2, prefills), "the restarted router synced", timeout=10)
    assert index_sizes(a2) == index_sizes(b)
    same_settled_loads(a2, b, prefills)
    assert [decision(a2, p) for p in probes] == seen
    cluster["routers"][0] = a2


def generate(address: str, **fields) -> list:
    with grpc.insecure_channel(address) as channel:
        return list(gpb_grpc.GeneratorStub(channel).Generate(gpb.GenerateRequest(**fields), timeout=60))


def test_grpc_generate_through_the_router(cluster):
    prefills, decode = cluster["prefills"], cluster["decode"]
    router = cluster["routers"][1]
    request = dict(prompt=SYSTEMS[0] + "gRPC?", max_tokens=6, temperature=0.0)
    routed = generate(router.grpc_address, **request)
    direct = generate(prefills[0].grpc_address, **request)
    assert [t for r in routed for t in r.token_ids] == [t for r in direct for t in r.token_ids]
    assert routed[-1].finish_reason and routed[-1].completion_tokens == direct[-1].completion_tokens
    decided = metric(router.url, "pdserve_router_decisions_total")
    assert decided >= 1

    # bad input: the prefill's own status and message
    for bad in (dict(prompt="x", max_tokens=-1), dict(model="nope", prompt="x"), dict()):
        with pytest.raises(grpc.RpcError) as via_router:
            generate(router.grpc_address, **bad)
        with pytest.raises(grpc.RpcError) as via_prefill:
            generate(prefills[0].grpc_address, **bad)
        assert via_router.value.code() == via_prefill.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert via_router.value.details() == via_prefill.value.details()

    # a client that cancels mid-stream: the prefill that served it sees the cancellation
    cancelled_before = sum(metric(p.url, "pdserve_requests_total", outcome="cancelled") for p in prefills)
    with grpc.insecure_channel(router.grpc_address) as channel:
        call = gpb_grpc.GeneratorStub(channel).Generate(
            gpb.GenerateRequest(prompt="stream me", max_tokens=1500, ignore_eos=True), timeout=60)
        next(call)
        call.cancel()
    wait_until(lambda: sum(metric(p.url, "pdserve_requests_total", outcome="cancelled") for p in prefills)
               > cancelled_before, "a prefill to see the cancellation", timeout=10)

    readings = wait_all_released([*prefills, decode])
    assert nothing_held(readings), readings
    for r in cluster["routers"]:
        health = get_json(r.url + "/health")[1]
        assert health["in_flight"] == 0 and all(p["in_flight_here"] == 0 for p in health["prefills"].values())
