"""The router's side of streams that outlive their prefill (router/resume.py; the contract is
pdserve/stream_resume.py).

- ``EventRelay`` cuts the prefill's extension out of each event, whatever the chunking: the client's
  bytes are the prefill's bytes without it; it keeps the tokens, id, created and the stream's stage;
- in process, over real HTTP (harness/router_fakes.py): prefill A streams a script (events built with
  the prefill's own functions) and its connection closes mid-event, as a killed process's does; the
  router resumes the stream on prefill B with the tokens the client has. At every stage (after k token
  events, after the finish event, after the usage event) the client's bytes equal the uninterrupted
  stream's: one [DONE], no token twice or missing. A resume B refuses, and a stream that cannot be
  resumed, end with an error event and [DONE]; a request whose prefill breaks before its response
  started goes whole to the other prefill.
"""

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from harness.router_fakes import counter, router_over, set_load
from pdserve.net import free_ports
from pdserve.prefill_server import openai_api as oa
from pdserve.prefill_server.resume import tag
from pdserve.router.resume import EventRelay, split_event
from pdserve.stream_resume import EVENT_KEY, RESUMABLE_HEADER, RESUME_FIELD

SCRIPT = list(b"every token once")
N = len(SCRIPT)
BODY = {"model": "tiny", "prompt": "go", "max_tokens": N, "stream": True, "stream_options": {"include_usage": True}}


def events(parsed, start: int = 0, tagged: bool = True, finish_sent: bool = False,
           usage_sent: bool = False) -> list[bytes]:
    """The script's stream as a prefill writes it, from token ``start`` on."""
    def sse(payload, ids=(), **more):
        return oa.sse(tag(payload, ids, **more) if tagged else payload)

    out = [sse(oa.chunk(parsed, chr(t), None), [t]) for t in SCRIPT[start:]]
    out += [] if finish_sent else [sse(oa.chunk(parsed, "", "length"), finish_reason="length")]
    out += [] if usage_sent else [sse(oa.usage_chunk(parsed, 3, N), usage=True)]
    return out + [oa.sse("[DONE]")]


class ScriptPrefill:
    """Streams SCRIPT (from a resume field's position, under its id and created). ``die``: (events, bytes of
    the next one) after which its connection closes, as a killed process's; ``answer``: (status, body) instead."""

    def __init__(self, port: int, die: tuple[int, int] | None = None, answer=None, tagged: bool = True):
        self.port, self.die, self.answer, self.tagged = port, die, answer, tagged
        self.bodies: list[dict] = []
        self.headers: list[dict] = []

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if self.answer is not None:
            return web.json_response(self.answer[1], status=self.answer[0])
        parsed = oa.parse_completion(body, "tiny")
        field = body.get(RESUME_FIELD) or {}
        if field:
            parsed.response_id, parsed.created = field["id"], field["created"]
        stream = events(parsed, len(field.get("token_ids", ())), self.tagged, finish_sent="finish_reason" in field)
        if not parsed.stream:
            if self.die is not None:
                request.transport.close()
                return web.Response()
            return web.json_response({"choices": [{"text": bytes(SCRIPT).decode()}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.die is None:
            for event in stream:
                await resp.write(event)
            await resp.write_eof()
            return resp
        whole, part = self.die
        await resp.write(b"".join(stream[:whole]) + stream[whole][:part])
        request.transport.close()  # what a SIGKILL leaves: the bytes sent, then the end of the connection
        return resp

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        return app


def test_the_extension_is_cut_out_whatever_the_chunking():
    parsed = oa.parse_completion(BODY, "tiny")
    tagged, plain = events(parsed), events(parsed, tagged=False)
    assert all(EVENT_KEY.encode() in e for e in tagged[:-1]) and tagged[-1] == plain[-1]
    assert [split_event(e)[0] for e in tagged] == plain
    whole = b"".join(tagged)
    for size in (1, 2, 3, 7, 64, len(whole)):
        relay = EventRelay()
        out = b"".join(relay.feed(whole[i:i + size]) for i in range(0, len(whole), size))
        assert out == b"".join(plain), size
        assert relay.token_ids == SCRIPT and relay.finish_reason == "length" and relay.usage_sent and relay.done
        assert (relay.id, relay.created) == ("cmpl-" + parsed.request_id, parsed.created) and relay.events == N + 3
    relay = EventRelay()  # a partial event waits for its end, and goes when its upstream breaks
    assert relay.feed(tagged[0] + tagged[1][:10]) == plain[0] and relay.token_ids == SCRIPT[:1]
    assert relay.can_resume and not relay.only_done_left
    relay.restart()
    assert relay.feed(tagged[1]) == plain[1] and relay.token_ids == SCRIPT[:2]


def test_a_stream_without_the_extension_cannot_be_resumed():
    parsed = oa.parse_completion(BODY, "tiny")
    relay = EventRelay()
    assert relay.feed(b"".join(events(parsed, tagged=False)[:3])) == b"".join(events(parsed, tagged=False)[:3])
    assert not relay.can_resume and relay.token_ids == []
    # a resumed upstream must carry it: an event without it (a prefill that does not know the contract) is held
    # back and breaks the relay; an error event goes through
    relay = EventRelay()
    relay.feed(events(parsed)[0])
    relay.restart()
    error = oa.sse(oa.error_body("the decode failed", "server_error", code="decode_failed"))
    assert relay.feed(error) == error and relay.error_sent and not relay.can_resume
    relay.restart()
    assert relay.feed(events(parsed, tagged=False)[1] + events(parsed)[2]) == b"" and relay.broken


async def _stream(url: str, body: dict = BODY) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.read()


async def _over(a: ScriptPrefill, b: ScriptPrefill, scenario, prefill_wait_s: float = 5.0):
    """The router over A and B; A ranks first (B reports load)."""
    async with router_over({"a": a, "b": b}, prefill_wait_s) as (router, api, url):
        set_load(a.watch, a.port)
        set_load(b.watch, b.port, in_flight=3)
        result = await scenario(url, api)
        assert api.in_flight == 0 and a.watch.in_flight == 0 and b.watch.in_flight == 0
        return result


def _expected(got: bytes) -> bytes:
    """The uninterrupted stream without the extension, under the id and created the client got."""
    head = json.loads(got.split(b"\n\n")[0][6:])
    parsed = oa.parse_completion(BODY, "tiny")
    parsed.response_id, parsed.created = head["id"], head["created"]
    return b"".join(events(parsed, tagged=False))


# (events that went out whole, bytes of the next one): after k tokens, all tokens, the finish, the usage
CUTS = [(1, 9), (5, 0), (N - 1, 30), (N, 12), (N + 1, 5), (N + 2, 3)]


@pytest.mark.parametrize("die", CUTS)
def test_a_stream_whose_prefill_dies_is_resumed_on_another(die):
    a, b = free_ports(2)
    a, b = ScriptPrefill(a, die=die), ScriptPrefill(b)

    async def scenario(url, api):
        status, got = await _stream(url)
        assert status == 200 and got == _expected(got)
        assert got.count(b"[DONE]") == 1 and EVENT_KEY.encode() not in got
        assert a.headers[0][RESUMABLE_HEADER] == "1"
        if die[0] == N + 2:  # only [DONE] was missing: the router wrote it
            assert b.bodies == []
        else:
            (resumed,) = b.bodies
            field = resumed.pop(RESUME_FIELD)
            assert resumed == BODY and field["token_ids"] == SCRIPT[:min(die[0], N)]
            assert field.get("finish_reason") == ("length" if die[0] > N else None)
            assert b.headers[0][RESUMABLE_HEADER] == "1" and 0 < float(b.headers[0]["X-Request-Timeout"]) <= 600
        assert counter(api, "pdserve_router_resumes_total", outcome="resumed") == 1
        assert counter(api, "pdserve_requests_total", outcome="ok", reason="resumed") == 1

    asyncio.run(_over(a, b, scenario))


def test_a_resume_the_other_prefill_refuses_ends_with_an_error_event():
    a, b = free_ports(2)
    refusal = oa.error_body("pdserve_resume.token_ids: ...", param="pdserve_resume.token_ids")
    a, b = ScriptPrefill(a, die=(3, 5)), ScriptPrefill(b, answer=(400, refusal))

    async def scenario(url, api):
        status, got = await _stream(url)
        *sent, error, done, end = got.split(b"\n\n")
        assert status == 200 and sent == _expected(got).split(b"\n\n")[:3]
        err = json.loads(error[6:])["error"]
        assert err["code"] == "prefill_failed" and "answered 400: pdserve_resume.token_ids" in err["message"]
        assert done == b"data: [DONE]" and end == b""
        assert counter(api, "pdserve_router_resumes_total", outcome="failed") == 1

    asyncio.run(_over(a, b, scenario, prefill_wait_s=0.2))  # then no prefill is left to try: the wait for one


def test_a_stream_that_cannot_be_resumed_ends_with_an_error_event():
    a, b = free_ports(2)
    a, b = ScriptPrefill(a, die=(3, 5), tagged=False), ScriptPrefill(b)

    async def scenario(url, api):
        status, got = await _stream(url)
        *sent, error, done, end = got.split(b"\n\n")
        assert status == 200 and len(sent) == 3 and json.loads(error[6:])["error"]["code"] == "prefill_failed"
        assert done == b"data: [DONE]" and b.bodies == []
        assert counter(api, "pdserve_router_resumes_total") == 0

    asyncio.run(_over(a, b, scenario))


@pytest.mark.parametrize("stream", [True, False])
def test_a_prefill_that_breaks_before_its_response_started_is_retried_whole(stream):
    a, b = free_ports(2)
    a, b = ScriptPrefill(a, die=(0, 7)), ScriptPrefill(b)

    async def scenario(url, api):
        status, got = await _stream(url, {**BODY, "stream": stream, "stream_options": None})
        assert status == 200 and len(a.bodies) == 1 and b.bodies == [{**BODY, "stream": stream, "stream_options": None}]
        if stream:
            assert got == _expected(got) and RESUME_FIELD not in b.bodies[0]
        else:
            assert json.loads(got)["choices"][0]["text"] == bytes(SCRIPT).decode()
        assert counter(api, "pdserve_router_resumes_total") == 0

    asyncio.run(_over(a, b, scenario))
