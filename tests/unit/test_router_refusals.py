"""The router's HTTP relay across a rollout's gap, over real HTTP: prefills here are small aiohttp servers
(one answers 503 ``no_decode_available``, as a prefill whose decodes left; one serves), and their loads are
set by hand instead of polled (the node tier's protocol rollout is the real-process test of the same path).

- a prefill that has no decode for the request is skipped for the next one (reason ``retry``);
- with no prefill routable the request waits (bounded by ``prefill_wait_s``) and is served once one is;
- when the wait runs out: the refusing prefill's own 503 body, or the router's "no prefill is routable".
"""

import asyncio
import json
import time

import aiohttp
from aiohttp import web

from harness.router_fakes import counter, router_over, set_load
from pdserve.net import free_ports

BODY = {"model": "tiny", "prompt": [256, 65, 66, 67], "max_tokens": 2}
HANG_GUARD_S = 30.0  # only a hang guard
REFUSAL = {"error": {"message": "no decode server could take the request: none is known", "type": "service_unavailable",
                     "param": None, "code": "no_decode_available"}}


class FakePrefill:
    """An HTTP server answering /v1/completions with 503 no_decode_available (``refuse``) or 200."""

    def __init__(self, port: int, refuse: bool):
        self.port, self.refuse, self.calls = port, refuse, 0

    async def completions(self, request: web.Request) -> web.Response:
        self.calls += 1
        if self.refuse:
            return web.json_response(REFUSAL, status=503)
        return web.json_response({"object": "text_completion", "choices": [{"text": f"served by {self.port}"}]})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        return app


async def with_router(scenario, prefill_wait_s: float = 5.0):
    """Run ``scenario(router, api_url, fakes, api)`` against a RouterApi over two fake prefills (loads unset)."""
    http = free_ports(2)
    fakes = {"refusing": FakePrefill(http[0], refuse=True), "serving": FakePrefill(http[1], refuse=False)}
    async with router_over(fakes, prefill_wait_s) as (router, api, url):
        return await scenario(router, url, fakes, api)


async def post(url: str) -> tuple[int, dict, float]:
    start = time.monotonic()
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=BODY) as r:
        return r.status, json.loads(await r.read()), time.monotonic() - start


def decisions(api, reason: str) -> float:
    return counter(api, "pdserve_router_decisions_total", reason=reason)


def test_a_prefill_without_a_decode_is_skipped_for_the_next():
    async def scenario(router, url, fakes, api):
        set_load(fakes["refusing"].watch, fakes["refusing"].port)
        set_load(fakes["serving"].watch, fakes["serving"].port, in_flight=3)  # ranks second: the refusing one first
        assert router.decide(BODY["prompt"]).address == fakes["refusing"].watch.address
        status, body, _ = await post(url)
        assert status == 200 and body["choices"][0]["text"] == f"served by {fakes['serving'].port}", body
        assert fakes["refusing"].calls == 1 and fakes["serving"].calls == 1
        assert decisions(api, "retry") == 1
        assert api.in_flight == 0 and all(f.watch.in_flight == 0 for f in fakes.values())

    asyncio.run(with_router(scenario))


def test_with_no_prefill_routable_a_request_waits_for_one():
    async def scenario(router, url, fakes, api):
        waiting = asyncio.Event()  # the request found no prefill routable and waits for one
        decide_waiting = router.decide_waiting

        async def recorded(*args, **kwargs):
            waiting.set()
            return await decide_waiting(*args, **kwargs)

        router.decide_waiting = recorded

        async def later():
            await asyncio.wait_for(waiting.wait(), HANG_GUARD_S)
            assert fakes["serving"].calls == 0  # nothing was relayed while none was routable
            set_load(fakes["serving"].watch, fakes["serving"].port)

        (status, body, _), _ = await asyncio.gather(post(url), later())
        # served by the prefill that became routable while it waited, well before prefill_wait_s (5 s) ran out
        assert status == 200 and fakes["serving"].calls == 1, body

    asyncio.run(with_router(scenario))


def test_when_the_wait_runs_out_the_answer_names_why():
    async def scenario(router, url, fakes, api):
        status, body, waited = await post(url)  # nothing routable for the whole wait
        assert status == 503 and body["error"]["code"] == "no_prefill_available", body
        assert "no prefill is routable" in body["error"]["message"] and waited >= 0.5
        set_load(fakes["refusing"].watch,
                 fakes["refusing"].port)  # only a prefill without a decode, never reporting again
        status, body, waited = await post(url)
        assert status == 503 and body == REFUSAL and waited >= 0.5, body  # its own answer, after the wait
        assert fakes["refusing"].calls == 1  # not asked again before its next load report
        assert api.in_flight == 0 and fakes["refusing"].watch.in_flight == 0

    asyncio.run(with_router(scenario, prefill_wait_s=0.5))
