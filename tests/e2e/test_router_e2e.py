"""The router with real processes: 2 prefills + 1 decode + `pdserve router`, real gRPC and HTTP.

In one sequence (the processes are slow to start on a shared CPU):
- a conversation whose first turn went straight to prefill X (the one the router's tie-break
  would NOT pick) has its second turn routed to X, for its cached prefix (decision reason
  "prefix"; X's prompt-token counter moved, the other's did not);
- the routed answer equals the answer of the other prefill asked directly (greedy);
- bad input gets the prefill's own 400, byte for byte;
- X is SIGKILLed: the router drops its index entries and sends requests to the other;
- X restarts on the same ports: the router resyncs from its snapshot under a new epoch;
- afterwards nothing is held: KV blocks, Sessions, CacheStore entries, relays in flight.

The decode runs behind a test gate (harness/decode_gate.py), open except while a client leaves
mid-stream: closed, it holds that stream on the decode after its first token, so the request
cannot finish before the client's leaving reaches the prefill, however fast the CPU decodes or
slow the router is scheduled. Every wait is on a condition (an index entry, a cumulative counter),
bounded only by a hang guard.
"""

import json

import pytest

from harness.conditions import wait_until
from harness.decode_gate import DecodeGate
from harness.pd_cluster import (COMMON, Server, get_json, metric, nothing_held, post_json, start_decode, start_prefill,
                                wait_all_released, wait_ready)
from harness.procs import ProcessGroup
from harness.router_cluster import start_router
from pdserve.router.choice import rendezvous
from pdserve.router.prompt import load_tokenizer, prompt_key, prompt_token_ids

pytestmark = pytest.mark.slow

HANG_GUARD_S = 60.0  # only a hang guard: each wait below takes well under a second on an idle box
BS = 16
EXTRA = ("--block-size", str(BS))
SYSTEM = "You are a careful assistant. " * 12  # ~340 bytes: about 21 blocks of 16 tokens


def start_prefill_at(group, decodes, http_port, grpc_port, name) -> Server:
    proc = group.pdserve("prefill", "--port", str(http_port), "--grpc-port", str(grpc_port), "--decode",
                         ",".join(decodes), "--num-blocks", "64", *COMMON, *EXTRA, name=name)
    return Server(proc, http_port, grpc_port, 0, name)


def raw_post(url: str, data: bytes):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.headers.get("Content-Type"), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type"), exc.read()


def index_of(router: Server, prefill: Server) -> dict:
    return get_json(router.url + "/health")[1]["prefills"][prefill.grpc_address]


def sse_text(url: str, body: dict) -> str:
    import urllib.request

    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body | {"stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    text = ""
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers.get("Content-Type").startswith("text/event-stream")
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text += delta.get("content") or ""
    return text


def leave_mid_stream(url: str, body: dict) -> None:
    import http.client
    from urllib.parse import urlparse

    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(body | {"stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read(6) == b"data: "
    conn.sock.close()
    conn.close()


def chat(messages):
    return {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    gate = DecodeGate(tmp / "decode-gate", opened=True)
    group = ProcessGroup(log_dir=tmp / "logs")
    try:
        with pytest.MonkeyPatch.context() as mp:  # the decode only (start_decode passes our environment on)
            for name, value in gate.env.items():
                mp.setenv(name, value)
            decode = start_decode(group, num_blocks=128, extra=EXTRA, name="decode")
        wait_ready(decode)
        prefills = [start_prefill(group, [decode.grpc_address], extra=EXTRA, name=f"prefill{i}") for i in range(2)]
        for p in prefills:
            wait_ready(p)
        router = start_router(group, prefills)
        wait_ready(router)
        wait_until(lambda: all(index_of(router, p)["index"] and index_of(router, p)["index"]["synced"]
                               and index_of(router, p)["routable"] for p in prefills), "both prefills indexed",
                   HANG_GUARD_S)
        yield {"group": group, "decode": decode, "prefills": prefills, "router": router, "gate": gate}
    finally:
        gate.open()
        group.close()


def test_routing_follows_the_cache_and_survives_kill_and_restart(cluster):
    group, decode, router, gate = cluster["group"], cluster["decode"], cluster["router"], cluster["gate"]
    p0, p1 = cluster["prefills"]
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about prefill."}]
    ids = prompt_token_ids(json.dumps(chat(turn1)).encode(), "chat", load_tokenizer("tiny"))
    key = prompt_key(ids, BS)
    # X: the prefill the tie-break would not pick, so only the index can send the next turn there
    x, other = sorted((p0, p1), key=lambda p: rendezvous(key, p.grpc_address), reverse=True)

    status, first = post_json(x.url + "/v1/chat/completions", chat(turn1))
    assert status == 200, first
    wait_until(lambda: index_of(router, x)["index"]["blocks"] >= len(ids) // BS - 1, "turn 1's blocks in the index",
               HANG_GUARD_S)
    turn2 = turn1 + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And decode?"}]
    before = {p.name: metric(p.url, "pdserve_prompt_tokens_total") for p in (x, other)}
    status, routed = post_json(router.url + "/v1/chat/completions", chat(turn2))
    assert status == 200, routed
    assert metric(router.url, "pdserve_router_decisions_total", prefill=x.grpc_address, reason="prefix") == 1
    assert metric(router.url, "pdserve_router_prefix_hit_blocks_total") >= len(ids) // BS - 1
    assert metric(x.url, "pdserve_prefix_cache_hit_tokens_total") >= (len(ids) // BS - 1) * BS  # the engine's own count
    assert metric(other.url, "pdserve_prefix_cache_hit_tokens_total") == 0
    assert metric(x.url, "pdserve_prompt_tokens_total") - before[x.name] == routed["usage"]["prompt_tokens"]
    assert metric(other.url, "pdserve_prompt_tokens_total") == before[other.name]
    status, direct = post_json(other.url + "/v1/chat/completions", chat(turn2))
    assert status == 200 and direct["choices"][0]["message"]["content"] == routed["choices"][0]["message"]["content"]

    # streaming: the SSE chunks relayed as they come give the same text
    assert sse_text(router.url, chat(turn2)) == routed["choices"][0]["message"]["content"]
    # a client that leaves mid-stream: the router closes its upstream, the prefill cancels, and so does its Session
    # on the decode. The closed gate holds the stream on the decode after its first token, so it cannot finish
    # first; the prefill's request counter is cumulative, so no poll can miss the cancel.
    gate.close()
    try:
        leave_mid_stream(router.url, chat(turn2) | {"max_tokens": 1500, "ignore_eos": True})
        wait_until(lambda: sum(metric(p.url, "pdserve_requests_total", outcome="cancelled",
                                      reason="client_disconnected")
                               for p in (x, other)) == 1, "a prefill to see the client leave", HANG_GUARD_S)
        wait_until(lambda: get_json(decode.url + "/health")[1]["sessions"] == 0, "the decode to drop the held stream",
                   HANG_GUARD_S)
    finally:
        gate.open()

    # bad input: the prefill's own 400, byte for byte
    for bad in (b"{not json", json.dumps({"model": "tiny", "prompt": "x", "max_tokens": -1}).encode(),
                json.dumps({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}).encode()):
        for path in ("/v1/completions", "/v1/chat/completions"):
            via_router, via_prefill = raw_post(router.url + path, bad), raw_post(x.url + path, bad)
            assert via_router[0] == 400 and via_router == via_prefill

    # SIGKILL X: its index entries go at once, requests go to the other prefill
    old_epoch = index_of(router, x)["index"]["epoch"]
    group.kill(x.proc)
    wait_until(lambda: not index_of(router, x)["index"]["synced"] and not index_of(router, x)["routable"],
               "X dropped from the index", HANG_GUARD_S)
    assert index_of(router, x)["index"]["blocks"] == 0
    served_before = metric(router.url, "pdserve_router_decisions_total", prefill=other.grpc_address)
    for i in range(3):
        status, out = post_json(router.url + "/v1/chat/completions",
                                chat(turn2 + [{"role": "user", "content": f"#{i}"}]))
        assert status == 200, out
    assert metric(router.url, "pdserve_router_decisions_total", prefill=other.grpc_address) == served_before + 3

    # X restarts on the same ports: a new epoch, resynced from its snapshot
    x2 = start_prefill_at(group, [decode.grpc_address], x.http_port, x.grpc_port, "prefill-restarted")
    wait_ready(x2)
    wait_until(lambda: index_of(router, x2)["index"]["synced"] and index_of(router, x2)["routable"],
               "X back in the index", HANG_GUARD_S)
    assert index_of(router, x2)["index"]["epoch"] not in ("", old_epoch)
    assert index_of(router, x2)["index"]["epoch"] == index_of(router, x2)["load"]["epoch"]
    assert metric(router.url, "pdserve_router_index_resyncs_total", prefill=x2.grpc_address, reason="epoch") == 1
    status, out = post_json(router.url + "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 4})
    assert status == 200, out

    readings = wait_all_released([other, x2, decode], timeout=HANG_GUARD_S)
    assert nothing_held(readings), readings
    assert gate.held() == []
    wait_until(lambda: (h := get_json(router.url + "/health")[1])["in_flight"] == 0
               and all(p["in_flight_here"] == 0 for p in h["prefills"].values()), "the router's relays all ended",
               HANG_GUARD_S)
