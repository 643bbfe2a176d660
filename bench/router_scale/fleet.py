"""Stand-in prefills: many in one process, each speaking the prefill's real protocols to a router.

Each ``StandIn`` serves, on its own ports:

- gRPC ``KvEvents`` with pdserve's own ``KvEventsServicer`` and ``KvEventPublisher``
  (``pdserve/kv_events.py``: the snapshot, the numbered events, GetLoad) over a real grpc.aio server;
- HTTP ``POST /v1/completions`` (aiohttp): the prompt's token ids, an OpenAI SSE stream of
  ``max_tokens`` token events (``itl_s`` apart), the finish event and ``[DONE]``, each event carrying
  the resume extension when the router asks for it (``pdserve.stream_resume``), as a prefill writes them;
  ``stream: false`` gets one JSON response; ``GET /state``: its publisher's epoch and last seq and the blocks
it holds (what a router's index of it should say once it caught up).

What it stands in for is the engine: its "prefix cache" is an LRU of ``capacity`` block hashes (the
engine's chained hashes of the prompt, ``engine.block_manager.reusable_hashes``), so a request stores
the blocks it did not hold (one BLOCK_STORED event) and evicts the oldest beyond capacity: one
BLOCK_REMOVED event with all of them (``evictions="batched"``, as the engine publishes since
``BlockManager._pop_fresh_many``), or one event per block (``"per-block"``, as it did before).
``preload`` blocks of random hashes fill it at start, so a router's index is at size before the first
request. No model runs: the tokens are ``prompt[-1] + i`` and the prefill takes ``prefill_s``.

Run ``python -m pdserve.bench.router_scale.fleet '{"count": 64, ...}'``: it prints one JSON line
(``{"grpc": [...], "http": [...]}``) once every stand-in serves, and stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections import OrderedDict

import grpc
from aiohttp import web

from pdserve.engine.block_manager import reusable_hashes
from pdserve.kv_events import KvEventPublisher, KvEventsServicer
from pdserve.net import free_port
from pdserve.protos import kv_events_pb2 as kpb
from pdserve.protos import kv_events_pb2_grpc as kpb_grpc
from pdserve.stream_resume import EVENT_KEY, RESUMABLE_HEADER

BLOCK_SIZE = 64  # the engine's default (engine/defaults.py BLOCK_SIZE)
GRPC_OPTIONS = [("grpc.max_send_message_length", -1)]
EVICTIONS = ("batched", "per-block")


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class StandIn:
    def __init__(self, capacity: int, preload: int, prefill_s: float, itl_s: float, seed: int,
                 evictions: str = "batched"):
        if evictions not in EVICTIONS:
            raise ValueError(f"evictions must be one of {EVICTIONS}, got {evictions!r}")
        self.capacity, self.prefill_s, self.itl_s, self.evictions = capacity, prefill_s, itl_s, evictions
        self.publisher = KvEventPublisher(BLOCK_SIZE)  # the servers' own max_pending
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.in_flight = 0
        self.requests = 0
        self.http_port = 0
        self.grpc_port = 0
        self._preload(preload, seed)

    def _preload(self, n: int, seed: int) -> None:
        import numpy as np

        hashes = np.random.default_rng(seed).integers(-(2**63), 2**63 - 1, size=n, dtype="int64").tolist()
        self.cache = OrderedDict.fromkeys(hashes)
        for i in range(0, n, 50_000):
            self.publisher.stored(hashes[i:i + 50_000])

    def load(self) -> kpb.ServerLoad:
        return kpb.ServerLoad(ready=True, in_flight=self.in_flight, kv_blocks_free=max(0, self.capacity // 4),
                              kv_blocks_total=self.capacity, http_port=self.http_port, block_size=BLOCK_SIZE)

    def admit(self, ids: list[int]) -> int:
        """The prompt's blocks into the LRU: events as the engine publishes them; the cached blocks."""
        hashes = reusable_hashes(ids, BLOCK_SIZE)
        cached = 0
        for h in hashes:
            if h not in self.cache:
                break
            cached += 1
        new = [h for h in hashes[cached:] if h not in self.cache]
        for h in hashes[:cached]:
            self.cache.move_to_end(h)
        if new:
            self.cache.update(dict.fromkeys(new))
            self.publisher.stored(new)
        gone = [self.cache.popitem(last=False)[0] for _ in range(len(self.cache) - self.capacity)]
        if gone and self.evictions == "batched":
            self.publisher.removed(gone)
        elif gone:
            for h in gone:
                self.publisher.removed([h])
        return cached

    async def completions(self, request: web.Request) -> web.StreamResponse:
        doc = await request.json()
        ids = doc["prompt"]
        n = int(doc.get("max_tokens", 16))
        self.in_flight += 1
        self.requests += 1
        try:
            cached = self.admit(ids)
            if self.prefill_s:
                await asyncio.sleep(self.prefill_s)
            head = {"id": f"cmpl-{self.grpc_port}-{self.requests}", "object": "text_completion",
                    "created": int(time.time()), "model": "stand-in"}
            usage = {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n,
                     "prompt_tokens_details": {"cached_tokens": cached * BLOCK_SIZE}}
            if not doc.get("stream"):
                await asyncio.sleep(self.itl_s * n)
                return web.json_response({**head, "choices": [{"index": 0, "text": "x" * n, "logprobs": None,
                                                                "finish_reason": "length"}], "usage": usage})
            return await self._stream(request, head, ids[-1] if ids else 0, n)
        finally:
            self.in_flight -= 1

    async def _stream(self, request: web.Request, head: dict, last: int, n: int) -> web.StreamResponse:
        resumable = request.headers.get(RESUMABLE_HEADER) == "1"
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for i in range(n):
            if i and self.itl_s:
                await asyncio.sleep(self.itl_s)
            event = {**head, "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": None}]}
            if resumable:
                event[EVENT_KEY] = {"token_ids": [(last + i) % 256]}
            await resp.write(sse(event))
        event = {**head, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]}
        if resumable:
            event[EVENT_KEY] = {"token_ids": [], "finish_reason": "length"}
        await resp.write(sse(event) + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def state(self, request: web.Request) -> web.Response:
        """What a router's view of this stand-in should be once it caught up: epoch, last seq, blocks."""
        return web.json_response({"epoch": self.publisher.epoch, "seq": self.publisher.seq,
                                  "blocks": len(self.cache)})

    async def start(self, host: str) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        self._grpc = grpc.aio.server(options=GRPC_OPTIONS)
        kpb_grpc.add_KvEventsServicer_to_server(KvEventsServicer(self.publisher, self.load), self._grpc)
        self._grpc.add_insecure_port(f"{host}:{self.grpc_port}")
        await self._grpc.start()
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/state", self.state)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, self.http_port).start()

    async def stop(self) -> None:
        await self._grpc.stop(grace=None)
        await self._runner.cleanup()


async def serve(count: int, capacity: int, preload: int, prefill_s: float = 0.0, itl_s: float = 0.0,
                host: str = "127.0.0.1", seed: int = 0, evictions: str = "batched") -> None:
    fleet = [StandIn(capacity, preload, prefill_s, itl_s, seed * 1000 + i, evictions) for i in range(count)]
    for s in fleet:
        await s.start(host)
    print(json.dumps({"grpc": [f"{host}:{s.grpc_port}" for s in fleet],
                      "http": [f"http://{host}:{s.http_port}" for s in fleet]}), flush=True)
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, done.set)
    loop.add_signal_handler(signal.SIGINT, done.set)
    await done.wait()
    print(json.dumps({"requests": [s.requests for s in fleet]}), flush=True)
    for s in fleet:
        await s.stop()


if __name__ == "__main__":
    asyncio.run(serve(**json.loads(sys.argv[1])))
