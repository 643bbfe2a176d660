"""The router's event loop (``pdserve router --event-loop``): uvloop by default, the standard library's on
request; on uvloop both of the router's I/O stacks work in one loop: a prefill's KV events over grpc.aio into
the index and its load polls (``PrefillWatch``), and a request relayed over aiohttp to the prefill the index
chose (``RouterApi``)."""

import asyncio

import aiohttp
import grpc
import pytest
import uvloop
from aiohttp import web

from pdserve.discovery import StaticDiscovery
from pdserve.engine.block_manager import reusable_hashes
from pdserve.kv_events import KvEventPublisher, KvEventsServicer
from pdserve.kv_index import PrefixIndex
from pdserve.metrics import ServerMetrics
from pdserve.net import free_port
from pdserve.protos import kv_events_pb2 as kpb
from pdserve.protos import kv_events_pb2_grpc as kpb_grpc
from pdserve.router.cli import EVENT_LOOPS, loop_factory
from pdserve.router.http_api import RouterApi
from pdserve.router.prefills import PrefillSet
from pdserve.router.prompt import load_tokenizer
from pdserve.router.router import Router
from harness.conditions import until


def test_the_event_loop_flag_names_its_factory():
    assert EVENT_LOOPS == ("uvloop", "asyncio")
    assert loop_factory("asyncio") is None
    loop = loop_factory("uvloop")()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()
    with pytest.raises(ValueError, match="event loop must be one of"):
        loop_factory("trio")


class Prefill:
    """A prefill as the router meets it: KvEvents over grpc.aio, /v1/completions over aiohttp (one JSON answer
    naming itself)."""

    def __init__(self, name: str):
        self.name, self.publisher = name, KvEventPublisher(block_size=16, epoch=name)
        self.http_port, self.grpc_port = free_port(), free_port()

    def load(self) -> kpb.ServerLoad:
        return kpb.ServerLoad(ready=True, kv_blocks_free=100, kv_blocks_total=100, http_port=self.http_port,
                              block_size=16)

    async def completions(self, request: web.Request) -> web.Response:
        return web.json_response({"served_by": self.name, "prompt_tokens": len((await request.json())["prompt"])})

    async def start(self) -> None:
        self.grpc = grpc.aio.server()
        kpb_grpc.add_KvEventsServicer_to_server(KvEventsServicer(self.publisher, self.load), self.grpc)
        self.grpc.add_insecure_port(f"127.0.0.1:{self.grpc_port}")
        await self.grpc.start()
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.http_port).start()

    async def stop(self) -> None:
        await self.grpc.stop(None)
        await self.runner.cleanup()


def test_the_router_routes_by_kv_events_on_uvloop():
    async def main():
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        a, b = Prefill("a"), Prefill("b")
        for p in (a, b):
            await p.start()
        prompt = list(range(1000, 1000 + 16 * 8 + 1))
        b.publisher.stored(reusable_hashes(prompt, 16))  # b holds the prompt's 8 blocks
        index = PrefixIndex()
        prefills = PrefillSet(StaticDiscovery([f"127.0.0.1:{p.grpc_port}" for p in (a, b)]), index,
                              load_interval_s=0.05)
        router = Router(prefills, index, load_tokenizer("tiny"))
        api = RouterApi(router, ServerMetrics(role="router"), prefill_wait_s=5.0)
        runner = web.AppRunner(api.app())
        await prefills.start()
        try:
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            b_address = f"127.0.0.1:{b.grpc_port}"
            await until(lambda: len(prefills.routable()) == 2 and index.overlap(b_address, reusable_hashes(prompt, 16))
                        == 8, "both prefills routable, b's blocks in the index")
            async with aiohttp.ClientSession() as session:
                async with session.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": prompt}) as r:
                    assert r.status == 200
                    assert await r.json() == {"served_by": "b", "prompt_tokens": len(prompt)}
            assert api.relays.in_flight == {"http": 0, "grpc": 0}
            assert all(w.in_flight == 0 for w in prefills.watches.values())
        finally:
            await runner.cleanup()
            await prefills.stop()
            for p in (a, b):
                await p.stop()
        assert a.publisher.num_subscribers() == 0 and b.publisher.num_subscribers() == 0

    with asyncio.Runner(loop_factory=loop_factory("uvloop")) as runner:
        runner.run(main())
