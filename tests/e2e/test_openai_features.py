"""OpenAI features through the real ``openai`` client over P/D (one prefill, one decode, tcp):
lists of prompts (strings and token-id lists), ``echo``, ``n`` > 1 on both endpoints,
``stream_options.include_usage`` (with ``prompt_tokens_details.cached_tokens``), ``logprobs`` /
``top_logprobs`` (whole and streamed), and ``response_format`` (json_object, json_schema). After
the module every KV block, Session and CacheStore entry is released on both processes.
"""

import json

import pytest

from harness.pd_cluster import (get_json, metric, nothing_held, post_json, start_decode, start_prefill,
                                wait_all_released, wait_ready)
from harness.procs import ProcessGroup

pytestmark = pytest.mark.slow

M = "tiny"
CHAT = [{"role": "user", "content": "Say something"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    group = ProcessGroup(log_dir=tmp_path_factory.mktemp("openai-features") / "logs")
    try:
        decode = start_decode(group, "tcp", 64)
        wait_ready(decode)
        prefill = start_prefill(group, [decode.grpc_address], "tcp", 64)
        wait_ready(prefill)
        yield {"prefill": prefill, "decode": decode}
        readings = wait_all_released([prefill, decode])
        assert nothing_held(readings), json.dumps(readings)
    finally:
        group.close()


@pytest.fixture(scope="module")
def client(cluster):
    from openai import OpenAI

    return OpenAI(base_url=cluster["prefill"].url + "/v1", api_key="unused", max_retries=0)


def _one(client, prompt, **kw):
    return client.completions.create(model=M, prompt=prompt, max_tokens=8, temperature=0, **kw).choices[0].text


def test_prompt_list_and_n_greedy(client):
    out = client.completions.create(model=M, prompt=["Hello", "The fox"], n=2, max_tokens=8, temperature=0)
    assert [c.index for c in sorted(out.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    by = {c.index: c.text for c in out.choices}
    assert by[0] == by[1] == _one(client, "Hello")  # greedy: every sample of a prompt is the same
    assert by[2] == by[3] == _one(client, "The fox")
    assert out.usage.prompt_tokens == (1 + 5) + (1 + 7)  # each prompt once (BOS + bytes), not n times
    assert 4 <= out.usage.completion_tokens <= 4 * 8


def test_n_choices_share_the_prompts_prefill(cluster, client):
    """The siblings of a prompt start after its first choice's first token: its full blocks are then in
    prefill's prefix cache (each sibling's prefill computes only the last partial block) and in the
    decode's (only that block's KV moves)."""
    url = cluster["prefill"].url
    ids = [256] + [(7 * i) % 250 for i in range(150)]  # 151 tokens: 2 full blocks of 64, and 23 more
    before = metric(url, "pdserve_prefix_cache_hit_tokens_total")
    out = client.completions.create(model=M, prompt=ids, n=3, max_tokens=3, temperature=0)
    assert len({c.text for c in out.choices}) == 1 and len(out.choices) == 3
    assert metric(url, "pdserve_prefix_cache_hit_tokens_total") - before == 2 * 2 * 64  # 2 siblings x 2 blocks
    # and the decode held them too (its prefix cache): only the last block's KV moved for the siblings
    rid = out.id.removeprefix("cmpl-")
    timings = [get_json(f"{url}/debug/requests/{r}")[1] for r in (rid, f"{rid}-c1", f"{rid}-c2")]
    assert [t["decode_cached_blocks"] for t in timings] == [0, 2, 2], timings
    # usage counts the prompt once, as its first choice found the cache: a new prompt, nothing cached
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    # the same prompt again, streamed: its 2 full blocks come from the prefix cache (OpenAI's cached_tokens)
    chunks = list(client.completions.create(model=M, prompt=ids, max_tokens=3, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens == 151 and chunks[-1].usage.prompt_tokens_details.cached_tokens == 2 * 64


def test_token_id_prompts_with_echo(client):
    ids = [[256, *b"abc"], [256, *b"xyz!"]]
    out = client.completions.create(model=M, prompt=ids, echo=True, max_tokens=4, temperature=0)
    texts = {c.index: c.text for c in out.choices}
    assert texts[0].startswith("abc") and texts[1].startswith("xyz!")
    plain = client.completions.create(model=M, prompt=ids[0], max_tokens=4, temperature=0).choices[0].text
    assert texts[0] == "abc" + plain


def test_seeded_n_differ_and_reproduce(client):
    kw = dict(model=M, messages=CHAT, n=3, max_tokens=12, temperature=1.0, seed=11)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    texts = [c.message.content for c in sorted(a.choices, key=lambda c: c.index)]
    assert texts == [c.message.content for c in sorted(b.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1, texts
    assert [c.index for c in sorted(a.choices, key=lambda c: c.index)] == [0, 1, 2]


def test_streamed_n_with_usage(client):
    stream = client.chat.completions.create(model=M, messages=CHAT, n=2, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    text, events, finish = {0: "", 1: ""}, {0: 0, 1: 0}, {}
    for ch in chunks[:-1]:
        for c in ch.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
            else:
                events[c.index] += 1
    assert set(finish) == {0, 1} and text[0] == text[1]
    assert usage.completion_tokens == events[0] + events[1]
    whole = client.chat.completions.create(model=M, messages=CHAT, max_tokens=6, temperature=0)
    assert text[0] == whole.choices[0].message.content
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_tokenize_counts_as_the_routes_do(cluster, client):
    """vLLM's POST /tokenize: a conversation's ids are the chat route's prompt, a prompt's the completion route's."""
    url = cluster["prefill"].url
    status, chat = post_json(url + "/tokenize", {"model": M, "messages": CHAT})
    whole = client.chat.completions.create(model=M, messages=CHAT, max_tokens=1, temperature=0)
    assert status == 200 and chat["count"] == len(chat["tokens"]) == whole.usage.prompt_tokens, chat
    status, plain = post_json(url + "/tokenize", {"model": M, "prompt": "The fox"})
    assert status == 200 and plain["count"] == _usage(client, "The fox").prompt_tokens == 1 + 7
    assert post_json(url + "/detokenize", {"tokens": plain["tokens"][1:]}) == (200, {"prompt": "The fox"})
    status, err = post_json(url + "/tokenize", {"model": "nope", "prompt": "a"})
    assert status == 400 and err["error"]["code"] == "model_not_found", err


def _usage(client, prompt):
    return client.completions.create(model=M, prompt=prompt, max_tokens=1, temperature=0).usage


def test_streamed_completion_prompt_list_echo(client):
    chunks = list(client.completions.create(model=M, prompt=["ab", "cd"], echo=True, max_tokens=3, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = {0: "", 1: ""}
    for ch in chunks[:-1]:
        for c in ch.choices:
            text[c.index] += c.text
    assert text[0].startswith("ab") and text[1].startswith("cd")
    assert chunks[-1].usage.prompt_tokens == 6


def test_bad_shapes_get_400_naming_the_field(cluster):
    url = cluster["prefill"].url
    for route, body, param in [
        ("/v1/completions", {"prompt": ["a", 3]}, "prompt"),
        ("/v1/completions", {"prompt": "a", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "a", "echo": False, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": CHAT, "n": 99}, "n"),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema",
                                                                        "json_schema": {"schema": {"type": "nope"}}}},
         "response_format"),
    ]:
        status, got = post_json(url + route, {"model": M, "max_tokens": 2, **body})
        assert status == 400 and got["error"]["param"] == param, (body, got)
    status, got = post_json(url + "/v1/completions", {"model": M, "prompt": "ok", "max_tokens": 2})
    assert status == 200, got


def _colocated_logprobs(ids, max_tokens, k):
    """The engine's own greedy tokens and logprobs, in process (one engine, no P/D)."""
    import torch

    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, load_model

    torch.set_num_threads(1)
    engine = LLMEngine(load_model(M), EngineConfig(num_blocks=16, max_num_seqs=1))
    engine.add_request("x", ids, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=k))
    tokens, lps = [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            lps += out.logprobs or []
    return tokens, lps


def test_completion_logprobs_match_the_engine(client):
    ids = [256, *b"Once upon"]
    out = client.completions.create(model=M, prompt=ids, max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    tokens, expected = _colocated_logprobs(ids, 6, 3)
    assert len(lp.tokens) == len(tokens) == out.usage.completion_tokens
    # the first token's logprob was computed on prefill, the others on decode: all as colocated
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected], abs=1e-4)
    for got, e in zip(lp.top_logprobs, expected):
        assert len(got) == 3
        assert sorted(got.values(), reverse=True) == pytest.approx([v for _, v in e.top], abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_chat_logprobs_streamed(client):
    chunks = list(client.chat.completions.create(model=M, messages=CHAT, max_tokens=5, temperature=0, stream=True,
                                                 logprobs=True, top_logprobs=2))
    entries = [e for ch in chunks for c in ch.choices if c.logprobs for e in c.logprobs.content]
    whole = client.chat.completions.create(model=M, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                           top_logprobs=2)
    content = whole.choices[0].logprobs.content
    assert len(entries) == len(content) == whole.usage.completion_tokens
    for a, b in zip(entries, content):
        assert (a.token, a.bytes) == (b.token, b.bytes) and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert len(a.top_logprobs) == 2 and a.top_logprobs[0].logprob >= a.logprob - 1e-6  # greedy: the top one
    plain = client.chat.completions.create(model=M, messages=CHAT, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}, "tag": {"enum": ["a", "bc"]}},
          "required": ["n", "ok", "tag"], "additionalProperties": False}


def test_response_format_json_schema_and_object(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    out = client.chat.completions.create(model=M, messages=CHAT, max_tokens=40, temperature=1.0, seed=5, n=3,
                                         response_format=fmt)
    for c in out.choices:
        doc = json.loads(c.message.content)
        assert set(doc) == {"n", "ok", "tag"} and 0 <= doc["n"] <= 99 and doc["tag"] in ("a", "bc"), doc
        assert isinstance(doc["ok"], bool) and c.finish_reason == "stop"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=M, messages=CHAT, max_tokens=40, temperature=0, response_format=fmt, stream=True))
    assert set(json.loads(streamed)) == {"n", "ok", "tag"}
    obj = client.completions.create(model=M, prompt="data:", max_tokens=60, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    text = obj.choices[0].text
    assert text.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}, "days": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                    "additionalProperties": False}}}]


def test_tools_forced_required_auto_and_a_tool_turn(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model=M, messages=CHAT, tools=TOOLS, tool_choice=named, max_tokens=40,
                                         temperature=0)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    call = c.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["city"] in ("Oslo", "Rome") and 1 <= args["days"] <= 7
    req = client.chat.completions.create(model=M, messages=CHAT, tools=TOOLS, tool_choice="required", max_tokens=60,
                                         temperature=1.0, seed=3, parallel_tool_calls=False)
    calls = req.choices[0].message.tool_calls
    assert (req.choices[0].finish_reason == "tool_calls" and calls
            and {x.function.name for x in calls} <= {"get_weather", "now"})
    auto = client.chat.completions.create(model=M, messages=CHAT, tools=TOOLS, max_tokens=8, temperature=0)
    assert auto.choices[0].message.tool_calls is None and isinstance(auto.choices[0].message.content, str)
    # the call and its result go back to the model as a conversation (the chat template renders them)
    turn = CHAT + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    again = client.chat.completions.create(model=M, messages=turn, tools=TOOLS, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens > out.usage.prompt_tokens
    streamed = list(client.chat.completions.create(model=M, messages=CHAT, tools=TOOLS, tool_choice=named,
                                                   max_tokens=40, temperature=0, stream=True))
    deltas = [d for ch in streamed for ch_c in ch.choices for d in (ch_c.delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == args
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
