"""The router's own time per request (``router/residence.py``), over real HTTP: the relay in process in front of
small aiohttp servers playing prefills (``harness.router_fakes``) that take ``WORK_S`` to answer (a stream's
headers go out at once, its first event after the work; a plain answer after the work).

- ``pdserve_router_residence_seconds`` observes one value per request relayed (a retry after a refusal is still
  one request; a request no prefill could take, none);
- the prefill's work is not in it: each request's residence is at most the client's time less ``WORK_S``;
- ``GET /debug/residence?since=N`` gives each of those requests' two parts with the client's X-Request-Id.
"""

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web

from harness.router_fakes import counter, router_over, set_load
from pdserve.net import free_ports

WORK_S = 0.3  # the stand-in prefill's work on a request: what the router's own time must not include
REFUSAL = {"error": {"message": "no decode", "type": "service_unavailable", "param": None,
                     "code": "no_decode_available"}}


class SlowPrefill:
    """/v1/completions: after ``WORK_S``, one SSE event and [DONE] (stream: the headers before the work) or one JSON
    answer; ``refuse``: 503 no_decode_available at once."""

    def __init__(self, port: int, refuse: bool = False):
        self.port, self.refuse, self.calls = port, refuse, 0

    async def completions(self, request: web.Request) -> web.StreamResponse:
        doc = await request.json()
        self.calls += 1
        if self.refuse:
            return web.json_response(REFUSAL, status=503)
        if not doc.get("stream"):
            await asyncio.sleep(WORK_S)  # the prefill's work (what is measured: not a wait for a condition)
            return web.json_response({"object": "text_completion", "choices": [{"text": "x"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)  # the headers reach the router before the work
        await asyncio.sleep(WORK_S)
        await resp.write(b'data: {"choices": [{"text": "x"}]}\n\ndata: [DONE]\n\n')
        await resp.write_eof()
        return resp

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        return app


async def post(url: str, stream: bool, request_id: str) -> tuple[int, float]:
    body = {"model": "tiny", "prompt": [256, 65, 66, 67], "max_tokens": 1, "stream": stream}
    start = time.perf_counter()
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body,
                                                    headers={"X-Request-Id": request_id}) as r:
        await r.read()
        return r.status, time.perf_counter() - start


async def residence(url: str, since: int | str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/debug/residence?since={since}") as r:
        return r.status, json.loads(await r.read())


def observed(api) -> tuple[float, float]:
    return (counter(api, "pdserve_router_residence_seconds_count"),
            counter(api, "pdserve_router_residence_seconds_sum"))


def test_one_value_per_request_and_the_prefills_work_is_not_in_it():
    async def main():
        fakes = {"serving": SlowPrefill(free_ports(1)[0])}
        async with router_over(fakes) as (router, api, url):
            assert observed(api) == (0, 0)
            set_load(fakes["serving"].watch, fakes["serving"].port)
            took = {}
            for rid, stream in (("s1", True), ("j1", False), ("s2", True)):
                status, took[rid] = await post(url, stream, rid)
                assert status == 200 and took[rid] >= WORK_S
            count, total = observed(api)
            assert count == 3 and fakes["serving"].calls == 3
            status, doc = await residence(url, 0)
            assert status == 200 and doc["count"] == 3
            rows = {r["request_id"]: r for r in doc["requests"]}
            assert sorted(rows) == sorted(took) and [r["seq"] for r in doc["requests"]] == [1, 2, 3]
            for rid, row in rows.items():
                own = row["request_s"] + row["response_s"]
                assert 0 < row["body_s"] <= row["decided_s"] <= row["request_s"] and 0 <= row["response_s"], row
                # the router's own time and the prefill's work both lie within the client's time: the work is not
                # in the former (were it, own >= WORK_S > took - WORK_S while the client took < 2 * WORK_S)
                assert own <= took[rid] - WORK_S, (rid, own, took[rid])
            assert total == pytest.approx(sum(r["request_s"] + r["response_s"] for r in rows.values()))
            status, later = await residence(url, 2)
            assert [r["request_id"] for r in later["requests"]] == ["s2"]
            status, bad = await residence(url, "x")
            assert status == 400 and "since must be an integer" in bad["error"]

    asyncio.run(main())


def test_a_retried_request_is_one_value_and_a_request_no_prefill_took_none():
    async def main():
        ports = free_ports(2)
        fakes = {"refusing": SlowPrefill(ports[0], refuse=True), "serving": SlowPrefill(ports[1])}
        async with router_over(fakes, prefill_wait_s=0.05) as (router, api, url):
            status, _ = await post(url, True, "none")  # no prefill routable: the router's own 503
            assert status == 503 and observed(api)[0] == 0
            set_load(fakes["refusing"].watch, fakes["refusing"].port)
            set_load(fakes["serving"].watch, fakes["serving"].port, in_flight=3)  # ranks second
            status, took = await post(url, True, "retried")
            assert status == 200 and fakes["refusing"].calls == 1 and fakes["serving"].calls == 1
            assert observed(api)[0] == 1
            _, doc = await residence(url, 0)
            (row,) = doc["requests"]
            assert row["request_id"] == "retried" and row["request_s"] + row["response_s"] <= took - WORK_S
            assert api.in_flight == 0 and all(f.watch.in_flight == 0 for f in fakes.values())

    asyncio.run(main())
