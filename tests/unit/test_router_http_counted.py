"""The router's HTTP relay settles a request before its client can act on the end of its response
(router/http_api.py): from the response's last write to the request's count in ``pdserve_requests_total``
and the end of its in-flight figures (``_ClientResponse.end``, then the passage ``with relay`` closing),
nothing yields to the event loop, so a client, or a Prometheus scrape, that reads the count right after its
response finds it there: for a whole JSON answer and for an SSE stream, request after request. (An await
slipped in between fails this test; the gRPC relay had that race: ``test_router_grpc_resume``.)"""

import asyncio

import aiohttp
import pytest
from aiohttp import web

from harness.router_fakes import counter, router_over, set_load
from pdserve.net import free_ports

REQUESTS = 40


class Prefill:
    """Answers /v1/completions whole (JSON) or as a short SSE stream."""

    def __init__(self, port: int, sse: bool):
        self.port, self.sse = port, sse

    async def completions(self, request: web.Request) -> web.StreamResponse:
        if not self.sse:
            return web.json_response({"object": "text_completion", "choices": [{"text": "ok"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for text in ("a", "b"):
            await resp.write(f'data: {{"choices": [{{"index": 0, "text": "{text}"}}]}}\n\n'.encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        return app


@pytest.mark.parametrize("sse", [False, True], ids=["json", "sse"])
def test_a_request_is_counted_before_its_client_has_the_end(sse):
    (port,) = free_ports(1)
    fake = Prefill(port, sse)

    async def main():
        async with router_over({"p": fake}) as (router, api, url):
            set_load(fake.watch, fake.port)
            async with aiohttp.ClientSession() as session:
                for n in range(1, REQUESTS + 1):
                    async with session.post(url + "/v1/completions", json={"prompt": [1, 2], "stream": sse}) as r:
                        body = await r.read()
                        assert r.status == 200 and (b"[DONE]" in body) == sse, body
                        # nothing awaited between the client's last byte and these reads
                        assert counter(api, "pdserve_requests_total", outcome="ok", reason="relayed") == n
                        assert api.in_flight == 0 and fake.watch.in_flight == 0

    asyncio.run(main())
