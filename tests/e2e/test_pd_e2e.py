"""Acceptance through real processes: one prefill + two decodes on loopback, real gRPC,
both KV transports.

- 20 mixed greedy requests through P/D give exactly the colocated engine's tokens;
- the real ``openai`` client streams a chat completion;
- bad input gets a 400 OpenAI error body and the server keeps serving;
- afterwards KV blocks, Sessions and CacheStore entries are back to zero on every process.
"""

import json
import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from harness.pd_cluster import (get_json, nothing_held, post_json, start_decode, start_prefill, wait_all_released,
                                wait_ready)
from harness.procs import ProcessGroup

pytestmark = pytest.mark.slow

NUM_BLOCKS = 64


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def cluster(request, tmp_path_factory):
    transport = request.param
    group = ProcessGroup(log_dir=tmp_path_factory.mktemp(f"pd-{transport}") / "logs")
    try:
        decodes = [start_decode(group, transport, NUM_BLOCKS, name=f"decode{i}") for i in range(2)]
        for d in decodes:
            wait_ready(d)
        prefill = start_prefill(group, [d.grpc_address for d in decodes], transport, NUM_BLOCKS)
        wait_ready(prefill)
        yield {"transport": transport, "prefill": prefill, "decodes": decodes}
    finally:
        group.close()


def _requests():
    rng = random.Random(7)
    out = []
    for i in range(20):
        n_prompt = rng.choice([1, 5, 63, 64, 65, 130, 200, 333])
        ids = [256] + [rng.randrange(0, 256) for _ in range(n_prompt - 1)]
        max_tokens = rng.choice([1, 2, 7, 16, 40])
        out.append((f"req-{i}", ids, max_tokens))
    return out


def _colocated(reqs):
    import torch

    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, load_model

    torch.set_num_threads(1)
    engine = LLMEngine(load_model("tiny"), EngineConfig(num_blocks=NUM_BLOCKS * 2, max_num_seqs=8))
    for rid, ids, max_tokens in reqs:
        engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0))
    tokens = {rid: [] for rid, _, _ in reqs}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


def _grpc_generate(address, rid, ids, max_tokens):
    from pdserve.protos import generate_pb2 as gpb
    from pdserve.protos import generate_pb2_grpc as gpb_grpc

    with grpc.insecure_channel(address) as ch:
        stub = gpb_grpc.GeneratorStub(ch)
        got, finish = [], ""
        for resp in stub.Generate(gpb.GenerateRequest(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0,
                                                      request_id=rid), timeout=120):
            got += list(resp.token_ids)
            finish = resp.finish_reason or finish
        return got, finish


def test_twenty_mixed_greedy_requests_match_colocated(cluster):
    reqs = _requests()
    expected = _colocated(reqs)
    prefill = cluster["prefill"]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda r: _grpc_generate(f"127.0.0.1:{prefill.grpc_port}", *r), reqs))
    for (rid, ids, max_tokens), (got, finish) in zip(reqs, results):
        assert got == expected[rid], f"{rid} ({len(ids)} prompt tokens, max_tokens {max_tokens}) differs from colocated"
        assert finish in ("stop", "length")
    # every request went through a decode (no local fallback configured), both decodes used
    status, health = get_json(prefill.url + "/health")
    assert health["local_requests"] == 0
    served = [get_json(d.url + "/health")[1]["cachestore"]["frames_received"] for d in cluster["decodes"]]
    assert all(n > 0 for n in served), f"KV frames received per decode: {served}"
    readings = wait_all_released([prefill, *cluster["decodes"]])
    assert nothing_held(readings), readings


def test_http_completion_matches_grpc(cluster):
    prefill = cluster["prefill"]
    ids = [256, *b"The quick brown fox"]
    got, _ = _grpc_generate(f"127.0.0.1:{prefill.grpc_port}", "cmp-grpc", ids, 12)
    status, body = post_json(prefill.url + "/v1/completions",
                             {"model": "tiny", "prompt": ids, "max_tokens": 12, "temperature": 0})
    assert status == 200, body
    from pdserve.engine import load_model

    text = load_model("tiny").tokenizer.decode(got)
    assert body["choices"][0]["text"] == text
    assert body["usage"]["completion_tokens"] == len(got)


def test_openai_client_streams_chat(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=cluster["prefill"].url + "/v1", api_key="unused")
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Say hi"}], max_tokens=10, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    full = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hi"}], max_tokens=10,
                                          temperature=0)
    assert full.choices[0].message.content == text
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_openai_client_gets_one_event_per_token(cluster):
    """Every generated token is one SSE event, in order, also when its text is "" (a byte
    inside a UTF-8 character, EOS under ignore_eos): events before the finish == usage's
    completion_tokens, and their text joined is the non-streamed text."""
    from openai import OpenAI

    client = OpenAI(base_url=cluster["prefill"].url + "/v1", api_key="unused")
    # temperature 2 + seed: the tiny model emits bytes >= 0x80 and EOS, which release no text
    kw = dict(model="tiny", max_tokens=24, temperature=2.0, seed=1, extra_body={"ignore_eos": True})
    for kind in ("completion", "chat"):
        if kind == "completion":
            create, args = client.completions.create, dict(prompt="Say hi")
        else:
            create, args = client.chat.completions.create, dict(messages=[{"role": "user", "content": "Say hi"}])
        chunks = list(create(**args, **kw, stream=True, stream_options={"include_usage": True}))
        *events, finish, usage = chunks
        assert usage.choices == [] and usage.usage.completion_tokens == 24
        assert finish.choices[0].finish_reason == "length"
        assert all(c.choices[0].finish_reason is None for c in events)
        assert len(events) == usage.usage.completion_tokens, f"{kind}: {len(events)} token events"
        if kind == "completion":
            texts = [c.choices[0].text for c in [*events, finish]]
            full = create(**args, **kw).choices[0].text
        else:
            assert events[0].choices[0].delta.role == "assistant"
            assert all(c.choices[0].delta.content is not None for c in events)
            texts = [c.choices[0].delta.content or "" for c in [*events, finish]]
            full = create(**args, **kw).choices[0].message.content
        assert texts[:-1].count("") >= 3, f"{kind}: the prompt should produce tokens without text: {texts}"
        assert "".join(texts) == full


BAD = [
    (b"{not json", "invalid_json", None),
    (json.dumps({"prompt": "x"}).encode(), None, "model"),
    (json.dumps({"model": "tiny"}).encode(), None, "prompt"),
    (json.dumps({"model": "gpt-4", "prompt": "x"}).encode(), "model_not_found", "model"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": -3}).encode(), None, "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "x", "temperature": -1}).encode(), None, "temperature"),
    (json.dumps({"model": "tiny", "prompt": "x", "top_p": 0}).encode(), None, "top_p"),
    (json.dumps({"model": "tiny", "prompt": "x", "top_p": 1.01}).encode(), None, "top_p"),
    (json.dumps({"model": "tiny", "prompt": "x" * 3000}).encode(), "context_length_exceeded", "prompt"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2047}).encode(), "context_length_exceeded",
     "max_tokens"),
]


def test_bad_input_gets_400_and_server_keeps_serving(cluster):
    prefill = cluster["prefill"]
    for raw, code, param in BAD:
        status, body = post_json(prefill.url + "/v1/completions", None, raw=raw)
        assert status == 400, (raw, body)
        err = body["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        if code:
            assert err["code"] == code, err
        if param:
            assert err["param"] == param, err
    status, body = post_json(prefill.url + "/v1/chat/completions", {"model": "tiny", "messages": []})
    assert status == 400 and "messages" in body["error"]["message"]
    from pdserve.protos import generate_pb2 as gpb
    from pdserve.protos import generate_pb2_grpc as gpb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{prefill.grpc_port}") as ch:
        with pytest.raises(grpc.RpcError) as info:
            list(gpb_grpc.GeneratorStub(ch).Generate(gpb.GenerateRequest(prompt="x", top_p=2.0), timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in info.value.details()
    status, body = post_json(prefill.url + "/v1/completions",
                             {"model": "tiny", "prompt": "still serving", "max_tokens": 3,
                                                                 "ignore_eos": True})
    # ignore_eos: the random built-in model samples EOS first now and then (about 1 in 260)
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body
    readings = wait_all_released([prefill, *cluster["decodes"]])
    assert nothing_held(readings), readings


def test_seeded_sampling_through_pd_matches_colocated(cluster):
    import torch

    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, load_model
    from pdserve.protos import generate_pb2 as gpb
    from pdserve.protos import generate_pb2_grpc as gpb_grpc

    reqs = [(f"seeded-{i}", [256, *f"seed me {i}".encode()], dict(temperature=0.9, top_p=0.95, top_k=50, seed=100 + i))
            for i in range(4)]
    torch.set_num_threads(1)
    engine = LLMEngine(load_model("tiny"), EngineConfig(num_blocks=NUM_BLOCKS))
    for rid, ids, kw in reqs:
        engine.add_request(rid, ids, SamplingParams(max_tokens=12, ignore_eos=True, **kw))
    expected = {rid: [] for rid, _, _ in reqs}
    while engine.has_unfinished():
        for out in engine.step():
            expected[out.request_id] += out.new_token_ids
    with grpc.insecure_channel(f"127.0.0.1:{cluster['prefill'].grpc_port}") as ch:
        stub = gpb_grpc.GeneratorStub(ch)
        for rid, ids, kw in reqs:
            got = []
            for resp in stub.Generate(gpb.GenerateRequest(prompt_token_ids=ids, max_tokens=12, ignore_eos=True, **kw),
                                      timeout=60):
                got += resp.token_ids
            assert got == expected[rid], rid


def test_burst_beyond_kv_capacity_queues_and_succeeds(cluster):
    """64 concurrent requests need more KV blocks than both decodes have: refused ones wait
    for blocks (queue) instead of failing; afterwards nothing is held. (With nixl this also
    drives one sender agent against two receivers from two link threads at once.)"""
    import asyncio
    import random

    import aiohttp

    prefill = cluster["prefill"]
    rng = random.Random(3)

    async def one(session, i):
        body = {"model": "tiny", "prompt": "x" * rng.randint(1, 300), "max_tokens": rng.randint(1, 60),
                "temperature": 0, "stream": i % 2 == 0}
        async with session.post(prefill.url + "/v1/completions", json=body) as resp:
            text = await resp.text()
            return resp.status, '"error"' in text

    async def burst():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            return await asyncio.gather(*(one(session, i) for i in range(64)))

    results = asyncio.run(burst())
    assert results == [(200, False)] * 64, [r for r in results if r != (200, False)]
    # the contract is "released within the session timeout" (30 s by default); after a burst on a
    # busy machine a last Session was seen still closing after 10 s (once in four full runs)
    readings = wait_all_released([prefill, *cluster["decodes"]], timeout=40.0)
    assert nothing_held(readings), readings
