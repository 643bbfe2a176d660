"""Numbers validated at the edge: every numeric field of /v1/completions, /v1/chat/completions
and gRPC Generate is range-checked by the parser (one table, ``NUMBERS``), so odd but
well-formed numbers (10**30, 1e308, NaN, Infinity, booleans, strings, lists) are a
BadRequest naming the field and its range, never an engine or wire error (HTTP 500).

Also: every value the table accepts is one the engine's SamplingParams, the Session's
Sampling message and the sampler take without failing (the bounds are safe)."""

import json
import math

import pytest
import torch

from pdserve.engine.sampling import Sampler, SamplingParams
from pdserve.prefill_server.decode_session import sampling_to_proto
from pdserve.prefill_server.frontend import Frontend
from pdserve.prefill_server.grpc_api import GenerateServicer
from pdserve.prefill_server.openai_api import (
    INT32_MAX,
    INT64_MAX,
    MAX_STOP_SEQUENCES,
    MAX_STOP_TOKEN_IDS,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    NUMBERS,
    BadRequest,
    parse_chat,
    parse_completion,
    parse_json,
)
from pdserve.protos import generate_pb2 as gpb

M = "tiny"


def _id(v):
    return f"{type(v).__name__}:{str(v)[:12]}"


CONTEXT = 2048  # the tiny model's context length
VOCAB = 258  # the tiny model's vocabulary

# Wrong for every numeric field: huge, non-finite, wrong JSON type.
EVERYWHERE = [10**30, -(10**30), 2**64, 1e308, -1e308, math.nan, math.inf, -math.inf, True, "1", "", [1], [], {"a": 1}]
# Out of range for one field (on top of EVERYWHERE).
OUT_OF_RANGE = {
    "max_tokens": [0, -1, CONTEXT + 1, INT32_MAX + 1, 1.5],
    "max_completion_tokens": [0, -1, CONTEXT + 1, 2.5],
    "temperature": [-0.1, -1e-300, 2.0000001, 100, 1e30, 1e-300, 1e-6],
    "top_p": [0, 0.0, -0.5, 1.0000001, 2, 1e-300, 5e-324],
    "top_k": [-2, INT32_MAX + 1, 3_000_000_000, 0.5],
    "seed": [-1, INT64_MAX + 1, 2**63, 1.5],
    "n": [0, 17, -1, False],
    "best_of": [0, 2, False],  # best_of must equal n (1 here)
    "logprobs": [21, -1, 1.5],
    "top_logprobs": [21, -1, False],
    "presence_penalty": [-2.01, 2.01, 1e30],
    "frequency_penalty": [-2.01, 2.01, -1e30],
}
CHAT_ONLY = {"max_completion_tokens"}
NOT_A_NUMBER_IN_CHAT = {"logprobs"}  # a boolean there (top_logprobs is the number): test_chat_logprobs_is_a_boolean
assert set(OUT_OF_RANGE) == set(NUMBERS), "every field of the table has its out-of-range cases here"

CASES = [(endpoint, name, value) for endpoint in ("completion", "chat") for name in NUMBERS
         for value in EVERYWHERE + OUT_OF_RANGE[name]
         if (endpoint == "chat" or name not in CHAT_ONLY) and not (endpoint == "chat" and name in NOT_A_NUMBER_IN_CHAT)]
CASE_IDS = [f"{e}-{n}={_id(v)}" for e, n, v in CASES]


def _parse(endpoint: str, extra: dict):
    if endpoint == "completion":
        return parse_completion({"model": M, "prompt": "x", **extra}, M, CONTEXT, VOCAB)
    return parse_chat({"model": M, "messages": [{"role": "user", "content": "x"}], **extra}, M, CONTEXT, VOCAB)


@pytest.mark.parametrize("endpoint, name, value", CASES, ids=CASE_IDS)
def test_bad_number_is_a_bad_request_naming_field_and_range(endpoint, name, value):
    with pytest.raises(BadRequest) as info:
        _parse(endpoint, {name: value})
    exc = info.value
    assert exc.param == name
    assert exc.message.startswith(f"{name} must be "), exc.message
    assert "[" in exc.message or exc.message.startswith(f"{name} must be null"), f"no allowed range in {exc.message!r}"
    assert " got " in exc.message
    assert len(exc.message) < 300  # a 30-digit or 4000-digit number is not echoed whole


@pytest.mark.parametrize("endpoint, name, value", CASES, ids=CASE_IDS)
def test_bad_number_through_raw_json(endpoint, name, value):
    """The same, as the HTTP server sees it: json.dumps writes NaN/Infinity literals and json.loads accepts them."""
    body = parse_json(json.dumps({name: value, "model": M}).encode())
    if endpoint == "completion":
        body["prompt"] = "x"
    else:
        body["messages"] = [{"role": "user", "content": "x"}]
    with pytest.raises(BadRequest) as info:
        (parse_completion if endpoint == "completion" else parse_chat)(body, M, CONTEXT, VOCAB)
    assert info.value.param == name


def test_table_ranges():
    """The ranges as documented (docs: issue 9 item 4); a change here is deliberate."""
    r = {name: (f.kind, f.lo, f.hi, f.default) for name, f in NUMBERS.items()}
    assert r["max_tokens"] == (int, 1, INT32_MAX, None) == r["max_completion_tokens"]
    assert r["temperature"] == (float, MIN_TEMPERATURE, 2.0, 1.0) and NUMBERS["temperature"].also == (0,)
    assert r["top_p"] == (float, MIN_TOP_P, 1.0, 1.0)
    assert r["top_k"] == (int, -1, INT32_MAX, 0)
    assert r["seed"] == (int, 0, 2**63 - 1, None)
    assert r["n"] == (int, 1, 16, 1) and r["best_of"] == (int, 1, 16, None)
    assert r["logprobs"] == (int, 0, 20, None) and r["top_logprobs"] == (int, 0, 20, None)
    assert r["presence_penalty"] == (float, -2.0, 2.0, 0.0) == r["frequency_penalty"]


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
def test_null_and_absent_mean_the_default(endpoint):
    got = _parse(endpoint, {name: None for name in NUMBERS if endpoint == "chat" or name not in CHAT_ONLY}).sampling
    assert (got.max_tokens, got.temperature, got.top_p, got.top_k, got.seed) == (None, 1.0, 1.0, 0, None)
    assert _parse(endpoint, {}).sampling == got


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
def test_edges_of_every_range_are_accepted(endpoint):
    lows = {"max_tokens": 1, "temperature": 0, "top_p": MIN_TOP_P, "top_k": -1, "seed": 0, "n": 1, "best_of": 1,
            "logprobs": 0, "presence_penalty": -2, "frequency_penalty": -2.0}
    highs = {"max_tokens": CONTEXT, "temperature": 2, "top_p": 1, "top_k": INT32_MAX, "seed": INT64_MAX, "n": 4.0,
             "best_of": 4, "logprobs": 20, "presence_penalty": 2, "frequency_penalty": 2.0}
    if endpoint == "chat":  # logprobs is a boolean there, top_logprobs the number
        lows.update(logprobs=True, top_logprobs=0)
        highs.update(logprobs=True, top_logprobs=20)
    s = _parse(endpoint, lows).sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (1, 0.0, MIN_TOP_P, 0, 0)
    s = _parse(endpoint, highs).sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (CONTEXT, 2.0, 1.0, INT32_MAX, INT64_MAX)
    assert _parse(endpoint, {"temperature": MIN_TEMPERATURE, "max_tokens": 3.0}).sampling.max_tokens == 3


def test_max_tokens_over_the_context_is_context_length_exceeded():
    with pytest.raises(BadRequest) as info:
        _parse("completion", {"max_tokens": 10**30})
    assert info.value.code == "context_length_exceeded" and f"[1, {CONTEXT}]" in info.value.message
    # without a known context the wire's int32 bound still holds
    with pytest.raises(BadRequest, match=f"\\[1, {INT32_MAX}\\]"):
        parse_completion({"model": M, "prompt": "x", "max_tokens": 10**30}, M)


BAD_IDS = [-1, VOCAB, 10**30, 2**31, 1.0, 1.5, True, None, math.nan, math.inf, {"a": 1}]


@pytest.mark.parametrize("bad", BAD_IDS, ids=_id)
def test_prompt_token_ids_out_of_vocabulary_or_not_int(bad):
    with pytest.raises(BadRequest) as info:
        parse_completion({"model": M, "prompt": [1, 2, bad]}, M, CONTEXT, VOCAB)
    assert (info.value.param == "prompt" and f"[0, {VOCAB - 1}]" in info.value.message
            and "index 2" in info.value.message)


@pytest.mark.parametrize("bad", BAD_IDS, ids=_id)
def test_stop_token_ids_out_of_vocabulary_or_not_int(bad):
    with pytest.raises(BadRequest) as info:
        _parse("chat", {"stop_token_ids": [5, bad]})
    assert info.value.param == "stop_token_ids" and "index 1" in info.value.message


@pytest.mark.parametrize("extra, param", [
    ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop": ["a"] * (MAX_STOP_SEQUENCES + 1)}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"stop": 1e308}, "stop"),
])
def test_stop_list_sizes_and_types(extra, param):
    with pytest.raises(BadRequest) as info:
        _parse("completion", extra)
    assert info.value.param == param


def test_token_ids_without_a_vocabulary_stay_in_the_wire_range():
    assert parse_completion({"model": M, "prompt": [INT32_MAX]}, M).prompt_token_ids == [INT32_MAX]
    with pytest.raises(BadRequest, match="prompt"):
        parse_completion({"model": M, "prompt": [INT32_MAX + 1]}, M)


@pytest.mark.parametrize("raw", [b'{"model": "tiny", "prompt": "x", "seed": ' + b"9" * 5000 + b"}", b"[" * 100_000])
def test_numbers_and_nesting_json_cannot_hold(raw):
    """A 5000-digit integer (Python's int-digit limit: ValueError) and deep nesting (RecursionError) were 500s."""
    with pytest.raises(BadRequest) as info:
        parse_json(raw)
    assert info.value.code == "invalid_json"


# -- gRPC Generate: the proto's types bound some values, the table the rest ---------------
def _servicer():
    return GenerateServicer(Frontend(None, None, SamplingParams, M, CONTEXT, None, VOCAB))


GRPC_BAD = [
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": -math.inf}, "temperature"), ({"temperature": 1e308}, "temperature"),
    ({"temperature": -1.0}, "temperature"), ({"temperature": 1e-300}, "temperature"),
    ({"top_p": math.nan}, "top_p"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1e308}, "top_p"),
    ({"top_p": 1e-300}, "top_p"), ({"top_k": -2}, "top_k"), ({"top_k": -(2**31)}, "top_k"),
    ({"seed": -1}, "seed"), ({"seed": -(2**63)}, "seed"),
    ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": INT32_MAX}, "max_tokens"),
    ({"max_tokens": CONTEXT + 1}, "max_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": [INT32_MAX]}, "stop_token_ids"), ({"stop": [""]}, "stop"), ({"stop": ["a"] * 5}, "stop"),
    ({"prompt_token_ids": [1, -1]}, "prompt_token_ids"), ({"prompt_token_ids": [1, VOCAB]}, "prompt_token_ids"),
    ({"prompt_token_ids": [INT32_MAX]}, "prompt_token_ids"),
]


@pytest.mark.parametrize("fields, param", GRPC_BAD,
                         ids=[f"{list(f)[0]}={_id(list(f.values())[0])}" for f, _ in GRPC_BAD])
def test_grpc_generate_numbers(fields, param):
    req = gpb.GenerateRequest(**{"prompt_token_ids": [1, 2], **fields})
    with pytest.raises(BadRequest) as info:
        _servicer()._parse(req)
    assert info.value.param == param and param in info.value.message


def test_grpc_generate_defaults_and_edges():
    ids, sp = _servicer()._parse(gpb.GenerateRequest(prompt_token_ids=[1, 2]))
    assert ids == [1, 2] and (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed) == (16, 1.0, 1.0, 0, None)
    _, sp = _servicer()._parse(gpb.GenerateRequest(prompt_token_ids=[VOCAB - 1], max_tokens=CONTEXT - 1, temperature=0,
                                                   top_p=MIN_TOP_P, top_k=-1, seed=INT64_MAX,
                                                   stop_token_ids=[VOCAB - 1]))
    assert (sp.max_tokens, sp.temperature, sp.top_k, sp.seed) == (CONTEXT - 1, 0.0, 0, INT64_MAX)


# -- whatever the edge accepts, the engine and the wire take ------------------------------
EXTREMES = [
    dict(max_tokens=CONTEXT, temperature=2.0, top_p=1.0, top_k=INT32_MAX, seed=INT64_MAX,
         stop_token_ids=[VOCAB - 1] * MAX_STOP_TOKEN_IDS),
    dict(max_tokens=1, temperature=MIN_TEMPERATURE, top_p=MIN_TOP_P, top_k=-1, seed=0),
    dict(temperature=0, top_k=1),
]


@pytest.mark.parametrize("extra", EXTREMES)
def test_accepted_extremes_pass_engine_wire_and_sampler(extra):
    spec = _parse("completion", extra).sampling
    sp = Frontend(None, None, SamplingParams, M, CONTEXT, None,
                  VOCAB).sampling(spec, 0 if spec.max_tokens == CONTEXT else 1)
    # raised ValueError ("Value out of range") for seed/top_k/stop ids beyond the wire types
    msg = sampling_to_proto(sp)
    assert msg.top_k == sp.top_k and (msg.seed if msg.HasField("seed") else None) == sp.seed
    torch.manual_seed(0)
    logits = torch.randn(2, VOCAB) * 5
    logits[:, 0] = -50.0  # token 0 is what NaN probabilities collapse to
    tokens = Sampler(seed=0).sample(logits, [sp, sp], [0, 1])
    assert 0 not in tokens
    if sp.temperature <= MIN_TEMPERATURE or sp.top_p <= MIN_TOP_P or sp.top_k == 1 or sp.greedy:
        assert tokens == logits.argmax(dim=-1).tolist()


def test_chat_logprobs_is_a_boolean():
    for value in (1, 0, "true", 1.5):
        with pytest.raises(BadRequest) as info:
            _parse("chat", {"logprobs": value})
        assert info.value.param == "logprobs" and "boolean" in info.value.message
    with pytest.raises(BadRequest) as info:
        _parse("chat", {"top_logprobs": 3})
    assert info.value.param == "top_logprobs" and "logprobs: true" in info.value.message
    assert _parse("chat", {"logprobs": True, "top_logprobs": 3}).sampling.logprobs == 3
    assert _parse("chat", {"logprobs": False}).sampling.logprobs is None
