"""Streams that outlive their prefill (docs/design.md "Streams that outlive their prefill"), with real
processes: one decode, two prefills, `pdserve router`, the real `openai` client.

A stream (greedy /v1/completions; seeded chat) goes through the router; once the client holds K
tokens, the prefill relaying it is SIGKILLed. The router resumes the stream on the other prefill:
the client's events equal the fault-free run's one for one (no token twice or missing, the same id
and created, one chat role), exactly one [DONE], the usage of the one request. A non-streamed
request whose prefill dies before its answer is sent whole to the other prefill. A greedy gRPC Generate
stream through the router's gRPC port outlives its prefill the same way: its responses equal the
fault-free run's one for one (every token once, completion_tokens 1..N, one request id, one finish).
Afterwards nothing is held: decode and prefill KV blocks, Sessions, CacheStore entries, the router's
relays (HTTP and gRPC).

The decode's steps last at least STEP_FLOOR_S (a test hook), so a stream of MAX_TOKENS tokens lasts
longer than the test takes to kill its prefill once the client holds K tokens, on any CPU; the kill
is set off by the client's K-th token, never by a clock.
"""

import json

import grpc
import pytest

from harness.conditions import wait_until
from harness.pd_cluster import get_json, metric, nothing_held, wait_all_released, wait_ready
from harness.router_cluster import relays_in_flight, start_prefills, start_router
from pdserve.net import free_port
from pdserve.protos import generate_pb2 as gpb
from pdserve.protos import generate_pb2_grpc as gpb_grpc

pytestmark = pytest.mark.slow

HANG_GUARD_S = 60.0  # only a hang guard
STEP_FLOOR_S = 0.01  # each decode step: a 400-token stream lasts >= 4 s
MAX_TOKENS = 400
K = 8  # tokens the client holds when its prefill dies
COMPLETION = dict(prompt="Once upon a time", max_tokens=MAX_TOKENS, temperature=0)
CHAT = dict(messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=MAX_TOKENS, temperature=1.0,
            seed=7)
GENERATE = dict(prompt="Once upon a time", max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture
def cluster(procs):
    decode, prefills = start_prefills(procs, 2, step_floor_s=STEP_FLOOR_S)
    router = start_router(procs, prefills, grpc_port=free_port())
    wait_ready(router)
    wait_until(lambda: all(w["routable"] for w in get_json(router.url + "/health")[1]["prefills"].values()),
               "both prefills routable", HANG_GUARD_S)
    return {"decode": decode, "prefills": prefills, "router": router}


def _client(router):
    from openai import OpenAI

    return OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD_S)


def _create(client, kind: str):
    return client.completions if kind == "completion" else client.chat.completions


def _args(kind: str) -> dict:
    return {**(COMPLETION if kind == "completion" else CHAT), "model": "tiny", "extra_body": {"ignore_eos": True},
            "stream_options": {"include_usage": True}}


def _text(kind: str, chunk: dict) -> str | None:
    if not chunk["choices"]:
        return None
    c = chunk["choices"][0]
    return c["text"] if kind == "completion" else c["delta"].get("content")


def _read(lines, on_data=None) -> tuple[list[dict], int]:
    """The stream's events as dicts and how many [DONE] came; ``on_data(n)`` after the n-th event."""
    events, done = [], 0
    for line in lines:
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done += 1
            continue
        event = json.loads(line[6:])
        assert "error" not in event, event
        events.append(event)
        if on_data is not None:
            on_data(len(events))
    return events, done


def _relaying(prefills) -> object:
    """The prefill with the stream in flight (the other has none)."""
    def busy():
        flights = [get_json(p.url + "/health")[1]["in_flight"] for p in prefills]
        return sorted(flights) == [0, 1] and prefills[flights.index(1)]
    return wait_until(busy, "one prefill relaying the stream", HANG_GUARD_S)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_stream_outlives_its_prefill(cluster, procs, kind):
    """greedy /v1/completions, seeded chat: the relaying prefill SIGKILLed once the client holds K tokens."""
    router, prefills, decode = cluster["router"], cluster["prefills"], cluster["decode"]
    client = _client(router)
    reference = list(_create(client, kind).create(**_args(kind), stream=True))  # fault-free, the openai types
    ref = [c.model_dump(exclude_unset=True) for c in reference]
    victim = None

    def kill_at_k(n: int) -> None:
        nonlocal victim
        if n == 1:
            victim = _relaying(prefills)
        if n == K:
            procs.kill(victim.proc)  # SIGKILL, while the stream runs (nearly 4 s of decode steps left)

    with _create(client, kind).with_streaming_response.create(**_args(kind), stream=True) as response:
        events, done = _read(response.iter_lines(), kill_at_k)
    assert victim is not None and victim.proc.poll() is not None, "the relaying prefill was not killed"
    assert metric(router.url, "pdserve_router_resumes_total", outcome="resumed") == 1

    assert done == 1
    assert [_text(kind, e) for e in events] == [_text(kind, c) for c in ref]  # every event, once, in order
    assert [e["choices"][0]["finish_reason"] if e["choices"] else "usage" for e in events] == \
        [c["choices"][0]["finish_reason"] if c["choices"] else "usage" for c in ref]
    *tokens, finish, usage = events
    # one request's usage; the prefix hit is the continuing prefill's own (pdserve.stream_resume)
    details = usage["usage"].pop("prompt_tokens_details")
    assert 0 <= details["cached_tokens"] <= usage["usage"]["prompt_tokens"], details
    assert finish["choices"][0]["finish_reason"] == "length" and \
        usage["usage"] == {k: v for k, v in ref[-1]["usage"].items() if k != "prompt_tokens_details"}
    assert usage["usage"]["completion_tokens"] == len(tokens) == MAX_TOKENS
    assert len({e["id"] for e in events}) == 1 and len({e["created"] for e in events}) == 1
    assert all("pdserve" not in e for e in events)
    if kind == "chat":
        assert [i for i, e in enumerate(events) if e["choices"] and e["choices"][0]["delta"].get("role")] == [0]

    survivor = next(p for p in prefills if p is not victim)
    readings = wait_all_released([survivor, decode], timeout=HANG_GUARD_S)
    assert nothing_held(readings), readings
    wait_until(lambda: not any(relays_in_flight(router).values()), "the router's relays all ended", HANG_GUARD_S)


def test_a_request_whose_prefill_dies_before_its_answer_is_sent_whole_to_the_other(cluster, procs):
    router, prefills, decode = cluster["router"], cluster["prefills"], cluster["decode"]
    client = _client(router)
    args = {**COMPLETION, "model": "tiny", "extra_body": {"ignore_eos": True}}
    reference = client.completions.create(**args)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(client.completions.create, **args)
        victim = _relaying(prefills)  # it computes the answer (>= 4 s of decode steps): nothing went out yet
        procs.kill(victim.proc)
        got = answer.result(timeout=HANG_GUARD_S)
    assert got.choices[0].text == reference.choices[0].text and got.usage == reference.usage
    survivor = next(p for p in prefills if p is not victim)
    assert metric(router.url, "pdserve_router_decisions_total", prefill=survivor.grpc_address, reason="retry") == 1
    readings = wait_all_released([survivor, decode], timeout=HANG_GUARD_S)
    assert nothing_held(readings), readings
    wait_until(lambda: not any(relays_in_flight(router).values()), "the router's relays all ended", HANG_GUARD_S)


def test_a_grpc_stream_outlives_its_prefill(cluster, procs):
    """greedy gRPC Generate through the router: the relaying prefill SIGKILLed once the client holds K tokens."""
    router, prefills, decode = cluster["router"], cluster["prefills"], cluster["decode"]
    victim, responses = None, []
    with grpc.insecure_channel(router.grpc_address) as channel:
        stub = gpb_grpc.GeneratorStub(channel)
        reference = list(stub.Generate(gpb.GenerateRequest(**GENERATE), timeout=HANG_GUARD_S))  # fault-free
        for response in stub.Generate(gpb.GenerateRequest(**GENERATE), timeout=HANG_GUARD_S):
            responses.append(response)
            if len(responses) == 1:
                victim = _relaying(prefills)
            if len(responses) == K:
                procs.kill(victim.proc)  # SIGKILL, while the stream runs (nearly 4 s of decode steps left)
    assert victim is not None and victim.proc.poll() is not None, "the relaying prefill was not killed"
    survivor = next(p for p in prefills if p is not victim)
    assert metric(router.url, "pdserve_router_resumes_total", outcome="resumed") == 1
    assert metric(router.url, "pdserve_router_decisions_total", prefill=survivor.grpc_address, reason="resume") == 1

    def shown(rs):
        return [(list(r.token_ids), r.text, r.finish_reason, r.completion_tokens, r.prompt_tokens) for r in rs]

    assert shown(responses) == shown(reference)  # every response, once, in order: no token twice or missing
    *tokens, finish = responses
    assert all(len(r.token_ids) == 1 for r in tokens) and len(tokens) == MAX_TOKENS
    assert [r.completion_tokens for r in responses] == [*range(1, MAX_TOKENS + 1), MAX_TOKENS]
    assert finish.finish_reason == "length" and not finish.token_ids
    assert len({r.request_id for r in responses}) == 1 and responses[0].request_id

    readings = wait_all_released([survivor, decode], timeout=HANG_GUARD_S)
    assert nothing_held(readings), readings
    wait_until(lambda: not any(relays_in_flight(router).values()), "the router's relays all ended", HANG_GUARD_S)
    assert metric(router.url, "pdserve_requests_total", outcome="ok", reason="resumed") == 1
