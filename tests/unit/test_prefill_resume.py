"""The prefill's side of streams that outlive their prefill (prefill_server/resume.py; the contract is
pdserve/stream_resume.py), in process: the real HttpApi and Frontend over real HTTP, the node a stand-in
that writes a fixed script (token n of the output is SCRIPT[n], as a deterministic model would).

- the ``pdserve_resume`` field is validated like any other: a 400 whose ``param`` names the field;
- with ``X-PDServe-Resumable: 1`` a stream that can be resumed carries each event's token ids, one that
  cannot (n > 1, echo) carries none;
- resumed after ANY number of events (every cut point of a stream with a multi-byte character and a stop
  string across the cut), the continuation is exactly the rest of the uninterrupted stream: the same
  events, the same id and created, no second chat role, usage counted as one request;
- gRPC Generate with ``resume_token_ids``: after any number of responses, the rest of the uninterrupted
  stream's responses (the same request id, completion_tokens counting the tokens before); a bad list is
  INVALID_ARGUMENT naming the field.
"""

import asyncio
import json

import aiohttp
import grpc
import pytest
from aiohttp import web

from pdserve.engine import SamplingParams
from pdserve.engine.tokenizer import ByteTokenizer
from pdserve.net import free_port
from pdserve.prefill_server.decode_session import Delta
from pdserve.prefill_server.frontend import Frontend
from pdserve.prefill_server.grpc_api import GenerateServicer
from pdserve.prefill_server.http_api import HttpApi
from pdserve.prefill_server.openai_api import BadRequest, parse_chat, parse_completion
from pdserve.prefill_server.resume import Resume, parse_resume
from pdserve.protos import generate_pb2 as gpb
from pdserve.protos import generate_pb2_grpc as gpb_grpc
from pdserve.stream_resume import EVENT_KEY, GRPC_RESUME_FIELD, RESUMABLE_HEADER, RESUME_FIELD

TOK = ByteTokenizer()
SCRIPT = list("Hé wrote: a STOP sign, then more".encode())  # 'é' is two tokens; "STOP" a stop string
COMPLETION = {"model": "tiny", "prompt": "go", "max_tokens": 24, "stream": True, "stop": ["STOP"],
              "stream_options": {"include_usage": True}}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 24, "stream": True,
        "stop": ["STOP"], "stream_options": {"include_usage": True}}


class ScriptNode:
    """Writes SCRIPT from the position after ``produced`` (which must be SCRIPT's start)."""

    def __init__(self):
        self.calls: list[tuple] = []

    async def generate(self, request_id, prompt_ids, sp, deadline=None, slo=None, produced=()):
        assert list(produced) == SCRIPT[:len(produced)]
        self.calls.append((request_id, list(prompt_ids), sp.max_tokens, list(produced)))
        for k in range(len(produced), sp.max_tokens):
            yield Delta([SCRIPT[k]])
        yield Delta([], True, "length")


async def _serve(scenario):
    node = ScriptNode()
    fe = Frontend(node, TOK, SamplingParams, "tiny", 2048, vocab_size=TOK.vocab_size)
    runner = web.AppRunner(HttpApi(fe, lambda: {}).app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as session:
            return await scenario(session, f"http://127.0.0.1:{port}", node)
    finally:
        await runner.cleanup()


async def _events(session, url: str, body: dict, resumable: bool = True) -> list:
    """The stream's events: dicts, then "[DONE]"."""
    headers = {RESUMABLE_HEADER: "1"} if resumable else {}
    async with session.post(url, json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        raw = (await resp.read()).decode()
    return [json.loads(e[6:]) if e != "data: [DONE]" else "[DONE]" for e in raw.split("\n\n") if e]


def _path(kind: str) -> str:
    return "/v1/completions" if kind == "completion" else "/v1/chat/completions"


def _shown(event):
    """What the client sees of an event (the router strips the extension)."""
    return event if event == "[DONE]" else {k: v for k, v in event.items() if k != EVENT_KEY}


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_stream_resumed_after_any_event_goes_on_as_the_whole_stream(kind):
    body = COMPLETION if kind == "completion" else CHAT

    async def scenario(session, url, node):
        whole = await _events(session, url + _path(kind), body)
        *events, done = whole
        assert done == "[DONE]" and all(EVENT_KEY in e for e in events)
        token_events = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"] is None]
        finish, usage = events[len(token_events)], events[-1]
        assert (finish["choices"][0]["finish_reason"] == "stop"
                and usage["usage"]["completion_tokens"] == len(token_events))
        assert [t for e in events for t in e[EVENT_KEY]["token_ids"]] == SCRIPT[:len(token_events)]
        assert finish[EVENT_KEY] == {"token_ids": [], "finish_reason": "stop"} and usage[EVENT_KEY]["usage"] is True
        for k in range(len(token_events) + 2):  # k events went out (the last two cuts: after the finish event)
            sent = [t for e in events[:k] for t in e[EVENT_KEY]["token_ids"]]
            field = {"token_ids": sent, "id": events[0]["id"], "created": events[0]["created"]}
            if k > len(token_events):
                field["finish_reason"] = "stop"
            rest = await _events(session, url + _path(kind), {**body, RESUME_FIELD: field})
            assert [_shown(e) for e in rest] == [_shown(e) for e in whole[k:]], f"resumed after {k} events"
            assert all(EVENT_KEY in e for e in rest[:-1])
        assert {c[1][-1] for c in node.calls} == ({ord("\n")} if kind == "chat" else {ord("o")})  # the prompt itself
        # the continuation was asked for prompt + the tokens the client had, each a new request to the node
        assert [c[3] for c in node.calls[1:len(token_events) + 1]] == [SCRIPT[:k] for k in range(len(token_events))]
        assert len({c[0] for c in node.calls}) == len(node.calls)

    asyncio.run(_serve(scenario))


def test_events_carry_token_ids_only_when_asked_and_resumable():
    async def scenario(session, url, node):
        plain = await _events(session, url + "/v1/completions", COMPLETION, resumable=False)
        assert all(EVENT_KEY not in e for e in plain[:-1])
        for extra in ({"n": 2}, {"echo": True}, {"prompt": ["a", "b"]}):
            events = await _events(session, url + "/v1/completions", {**COMPLETION, **extra})
            assert all(EVENT_KEY not in e for e in events[:-1]), extra

    asyncio.run(_serve(scenario))


BAD_FIELDS = [
    ("x", RESUME_FIELD),
    ({"token_ids": [1], "id": "cmpl-1", "created": 1, "more": 1}, RESUME_FIELD),
    ({"id": "cmpl-1", "created": 1}, f"{RESUME_FIELD}.token_ids"),
    ({"token_ids": [1, 258], "id": "cmpl-1", "created": 1}, f"{RESUME_FIELD}.token_ids"),  # outside the vocabulary
    ({"token_ids": [1, -1], "id": "cmpl-1", "created": 1}, f"{RESUME_FIELD}.token_ids"),
    ({"token_ids": [1, True], "id": "cmpl-1", "created": 1}, f"{RESUME_FIELD}.token_ids"),
    ({"token_ids": "abc", "id": "cmpl-1", "created": 1}, f"{RESUME_FIELD}.token_ids"),
    ({"token_ids": [1], "created": 1}, f"{RESUME_FIELD}.id"),
    ({"token_ids": [1], "id": "", "created": 1}, f"{RESUME_FIELD}.id"),
    ({"token_ids": [1], "id": "x\n", "created": 1}, f"{RESUME_FIELD}.id"),
    ({"token_ids": [1], "id": "x" * 257, "created": 1}, f"{RESUME_FIELD}.id"),
    ({"token_ids": [1], "id": "cmpl-1", "created": -1}, f"{RESUME_FIELD}.created"),
    ({"token_ids": [1], "id": "cmpl-1", "created": 1.5}, f"{RESUME_FIELD}.created"),
    ({"token_ids": [1], "id": "cmpl-1", "created": 1, "finish_reason": "abort"}, f"{RESUME_FIELD}.finish_reason"),
]


@pytest.mark.parametrize("field,param", BAD_FIELDS)
def test_a_malformed_resume_field_is_a_bad_request_naming_it(field, param):
    parsed = parse_completion(COMPLETION, "tiny", 2048, TOK.vocab_size)
    with pytest.raises(BadRequest) as info:
        parse_resume({**COMPLETION, RESUME_FIELD: field}, parsed, TOK.vocab_size)
    assert info.value.param == param and param in info.value.message


@pytest.mark.parametrize("extra,why", [({"stream": False, "stream_options": None}, "only a stream"),
                                       ({"n": 2}, "several choices"), ({"prompt": ["a", "b"]}, "several choices"),
                                       ({"echo": True}, "echo")])
def test_a_stream_that_cannot_be_resumed_refuses_the_field(extra, why):
    body = {**COMPLETION, **extra, RESUME_FIELD: {"token_ids": [1], "id": "cmpl-1", "created": 1}}
    parsed = parse_completion(body, "tiny", 2048, TOK.vocab_size)
    with pytest.raises(BadRequest, match=why):
        parse_resume(body, parsed, TOK.vocab_size)
    tools = {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
             RESUME_FIELD: {"token_ids": [1], "id": "x", "created": 1}}
    with pytest.raises(BadRequest, match="tools"):
        parse_resume(tools, parse_chat(tools, "tiny", 2048, TOK.vocab_size), TOK.vocab_size)


def test_the_tokens_against_max_tokens_and_stop_strings_over_http():
    async def scenario(session, url, node):
        async def error(field, **extra):
            async with session.post(url + "/v1/completions", json={**COMPLETION, **extra, RESUME_FIELD: field}) as r:
                return r.status, (await r.json())["error"]

        # more tokens than max_tokens (24): 400 naming the field; as many: only the finish is left
        status, err = await error({"token_ids": SCRIPT[:25], "id": "x", "created": 1}, max_tokens=24, stop=[])
        assert status == 400 and err["param"] == f"{RESUME_FIELD}.token_ids" and "max_tokens (24)" in err["message"]
        # a stop string that ends their text before their last token: the stream had ended there
        status, err = await error({"token_ids": SCRIPT[:18], "id": "x", "created": 1})  # "STOP" ends at 17
        assert status == 400 and err["param"] == f"{RESUME_FIELD}.token_ids" and "stop string" in err["message"]
        assert node.calls == []  # nothing ran
        events = await _events(session, url + "/v1/completions",
                               {**COMPLETION, "stop": [],
                                RESUME_FIELD: {"token_ids": SCRIPT[:24], "id": "x", "created": 1}})
        assert [e["choices"][0]["finish_reason"] for e in events[:-2]] == ["length"] and events[-2]["usage"] == {
            "prompt_tokens": 3, "completion_tokens": 24, "total_tokens": 27,  # BOS, g, o
            "prompt_tokens_details": {"cached_tokens": 0}}  # nothing ran
        assert node.calls == []

    asyncio.run(_serve(scenario))


def test_resume_check_counts_against_the_resolved_max_tokens():
    Resume([1] * 16, "x", 1).check(SamplingParams(max_tokens=16))
    with pytest.raises(BadRequest, match="more than the request's max_tokens"):
        Resume([1] * 17, "x", 1).check(SamplingParams(max_tokens=16))


# -- gRPC Generate: resume_token_ids (its responses already carry their token ids) -----------------------
GRPC_REQUEST = gpb.GenerateRequest(prompt="go", max_tokens=24, stop=["STOP"], request_id="rid-1")


async def _grpc(scenario):
    node = ScriptNode()
    fe = Frontend(node, TOK, SamplingParams, "tiny", 2048, vocab_size=TOK.vocab_size)
    server = grpc.aio.server()
    gpb_grpc.add_GeneratorServicer_to_server(GenerateServicer(fe), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = gpb_grpc.GeneratorStub(channel)

            async def generate(**fields) -> list:
                request = gpb.GenerateRequest()
                request.CopyFrom(GRPC_REQUEST)
                for name, value in fields.items():  # (only repeated fields here)
                    getattr(request, name)[:] = value
                return [r async for r in stub.Generate(request, timeout=30)]

            return await scenario(generate, node)
    finally:
        await server.stop(None)


def test_a_grpc_stream_resumed_after_any_response_goes_on_as_the_whole_stream():
    async def scenario(generate, node):
        whole = await generate()
        *tokens, finish = whole
        assert finish.finish_reason == "stop" and all(len(r.token_ids) == 1 for r in tokens)
        assert [r.token_ids[0] for r in tokens] == SCRIPT[:len(tokens)]
        assert [r.completion_tokens for r in whole] == [*range(1, len(tokens) + 1), len(tokens)]
        for k in range(len(tokens) + 1):  # k token responses went out (the last cut: all but the finish)
            rest = await generate(**{GRPC_RESUME_FIELD: SCRIPT[:k]})
            assert rest == whole[k:], f"resumed after {k} responses"
        # each continuation was asked for prompt + the tokens the client had, under an id of its own (k = 0 is
        # no resume: the request itself again)
        assert [c[3] for c in node.calls[1:len(tokens) + 1]] == [SCRIPT[:k] for k in range(len(tokens))]
        assert [c[0] for c in node.calls[:2]] == ["rid-1", "rid-1"]
        assert len({c[0] for c in node.calls[2:]} | {"rid-1"}) == len(node.calls) - 1

    asyncio.run(_grpc(scenario))


def test_bad_grpc_resume_token_ids_are_invalid_argument_naming_the_field():
    async def scenario(generate, node):
        for ids, why in (([1, 258], "integer token ids in [0, "), ([1, -1], "integer token ids in [0, "),
                         (SCRIPT[:25], "more than the request's max_tokens (24)")):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(**{GRPC_RESUME_FIELD: ids})
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert GRPC_RESUME_FIELD in info.value.details() and why in info.value.details(), info.value.details()
        assert node.calls == []  # nothing ran
        rest = await generate(stop=[], **{GRPC_RESUME_FIELD: SCRIPT[:24]})  # as many as max_tokens: the finish
        assert [(r.finish_reason, r.completion_tokens, list(r.token_ids)) for r in rest] == [("length", 24, [])]
        assert rest[0].prompt_tokens == 3 and node.calls == []  # BOS, g, o

    asyncio.run(_grpc(scenario))
