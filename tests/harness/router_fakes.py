"""The router's HTTP relay in process, over real HTTP, in front of small aiohttp servers playing prefills,
for the router's unit tests: each fake has ``port`` and ``app()``; its load is set by hand (``set_load``)
instead of polled, so which prefill the router picks is the test's choice.

    async with router_over(fakes) as (router, api, url):   # fakes: {name: fake}; each gets fake.watch
        set_load(fakes["a"].watch, fakes["a"].port)
        ... POST url + "/v1/completions" ...

``grpc_router_over`` is the same for the router's gRPC Generate relay: each fake is a ``GeneratorServicer``
with ``port`` (its gRPC port), served by a grpc.aio server (``fake.server``); yields (router, servicer, address).
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

import grpc
from aiohttp import web

from pdserve.discovery import StaticDiscovery
from pdserve.kv_index import PrefixIndex
from pdserve.metrics import ServerMetrics
from pdserve.net import free_port
from pdserve.protos import generate_pb2_grpc as gpb_grpc
from pdserve.protos import kv_events_pb2 as kpb
from pdserve.router.grpc_api import RouterGenerateServicer
from pdserve.router.http_api import RouterApi
from pdserve.router.prefill_watch import PrefillWatch
from pdserve.router.prefills import PrefillSet
from pdserve.router.prompt import load_tokenizer
from pdserve.router.router import Router


def set_load(watch: PrefillWatch, http_port: int, ready: bool = True, in_flight: int = 0) -> None:
    watch.load = kpb.ServerLoad(ready=ready, in_flight=in_flight, kv_blocks_free=100, kv_blocks_total=100,
                                http_port=http_port, block_size=16)
    watch.load_at = time.monotonic()


def counter(api: RouterApi, name: str, **labels) -> float:
    """The sum of the router's samples called ``name`` whose labels include ``labels``."""
    return sum(s.value for m in api.metrics.registry.collect() for s in m.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


@asynccontextmanager
async def router_over(fakes: dict, prefill_wait_s: float = 5.0):
    """A RouterApi (tokenizer: tiny's) over the fakes, all serving; yields (router, api, url). Loads unset."""
    prefills = PrefillSet(StaticDiscovery([]), PrefixIndex())
    metrics = ServerMetrics(role="router")
    router = Router(prefills, prefills.index, load_tokenizer("tiny"), metrics)
    runners = []
    try:
        for fake in fakes.values():
            address = f"127.0.0.1:{fake.port + 10000}"  # gRPC is never used here
            prefills.watches[address] = fake.watch = PrefillWatch(address, prefills.index, expiry_s=3600.0)
            runners.append(runner := web.AppRunner(fake.app()))
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", fake.port).start()
        api = RouterApi(router, metrics, prefill_wait_s=prefill_wait_s)
        runners.append(runner := web.AppRunner(api.app()))
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        yield router, api, f"http://127.0.0.1:{port}"
    finally:
        for runner in reversed(runners):
            await runner.cleanup()


@asynccontextmanager
async def grpc_router_over(fakes: dict, prefill_wait_s: float = 5.0):
    """A RouterGenerateServicer (tokenizer: tiny's) over the fakes' gRPC servers, all serving; yields (router,
    servicer, the router's gRPC address). Loads unset (``set_load(fake.watch, fake.port)`` makes one routable)."""
    prefills = PrefillSet(StaticDiscovery([]), PrefixIndex())
    metrics = ServerMetrics(role="router")
    router = Router(prefills, prefills.index, load_tokenizer("tiny"), metrics)
    servers = []
    try:
        for fake in fakes.values():
            fake.server = grpc.aio.server()
            servers.append(fake.server)
            gpb_grpc.add_GeneratorServicer_to_server(fake, fake.server)
            fake.server.add_insecure_port(f"127.0.0.1:{fake.port}")
            await fake.server.start()
            address = f"127.0.0.1:{fake.port}"
            prefills.watches[address] = fake.watch = PrefillWatch(address, prefills.index, expiry_s=3600.0)
        servicer = RouterGenerateServicer(router, metrics, prefill_wait_s=prefill_wait_s)
        servers.append(server := grpc.aio.server())
        gpb_grpc.add_GeneratorServicer_to_server(servicer, server)
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        yield router, servicer, f"127.0.0.1:{port}"
    finally:
        for server in reversed(servers):
            await server.stop(None)
        for watch in prefills.watches.values():
            await watch.stop()
