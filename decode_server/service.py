"""DecodeService: the gRPC ``Decode`` service of a decode process (Session + GetLoadReport).

The same gRPC port also serves ``KvEvents`` (``pdserve/kv_events.py``): this decode's prefix
cache (prompt blocks received and blocks its requests filled, kept after they finish) as a
snapshot then numbered events, so each prefill's decode picker knows which decode holds a
prompt's prefix; ``server_load`` is its GetLoad answer.

Lifecycle of one ``Session`` call: the service hands it to a new ``DecodeSession``
(decode_server/session.py lists the steps: admit -> allocate -> transfer -> decode ->
release) together with ``SessionDeps``, built once by ``wiring.build_service``: the
``DecodeEngine`` adapter (reserve / add_prefilled / release with the block gauges kept current),
the CacheStore receiver, the ``SessionRegistry`` (live sessions, draining flag),
``SessionMetrics`` and the fixed limits. ``GetLoadReport`` and ``counts()`` (for /health) read the same registry
and the engine's thread-safe ``num_free_blocks()`` / ``num_blocks``; with a KV pool
(``--kv-pool``) the load report also carries the room the pool offers (``pool_free_blocks``,
``pool_total_blocks``) and /health its loans (``kv_pool``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc

from pdserve.protos import kv_events_pb2 as kpb
from pdserve.protos import session_pb2 as pb
from pdserve.protos import session_pb2_grpc as pb_grpc
from pdserve.protos.version import PROTOCOL_VERSION
from pdserve.server_setup import merged_stats

from .registry import SessionInfo
from .session import DecodeSession, SessionDeps

if TYPE_CHECKING:
    from pdserve.engine.server_engine import ServerEngine

log = logging.getLogger(__name__)


class DecodeService(pb_grpc.DecodeServicer):
    """The Decode servicer over its built parts (``wiring.build_service``): ``engine`` for the load
    numbers, ``deps`` handed to every DecodeSession (its registry, receiver, compat and pool read
    here too), ``kv_bytes_per_block`` (all layers, K and V; with tensor parallelism one rank's pool: every rank holds
    the same block ids, so free blocks times it is the tightest rank's free memory) for the free bytes reported."""

    def __init__(self, engine: ServerEngine, deps: SessionDeps, kv_bytes_per_block: int):
        self.engine, self.deps, self.kv_bytes_per_block = engine, deps, kv_bytes_per_block
        self.registry, self.receiver, self.compat, self.pool = deps.registry, deps.receiver, deps.compat, deps.pool

    @property
    def sessions(self) -> dict[str, SessionInfo]:
        """Live sessions by request id (the registry's)."""
        return self.registry.sessions

    # -- gRPC -----------------------------------------------------------------------------
    async def Session(self, request_iterator, context: grpc.aio.ServicerContext):
        await DecodeSession(context, self.deps).run()

    async def GetLoadReport(self, request: pb.LoadReportRequest, context) -> pb.LoadReport:
        return self.load_report()

    def load_report(self) -> pb.LoadReport:
        free = self.engine.num_free_blocks()
        running = self.registry.running()
        pool_free, pool_total = self.pool.room() if self.pool is not None else (0, 0)
        return pb.LoadReport(
            free_blocks=free, total_blocks=self.engine.num_blocks, free_bytes=free * self.kv_bytes_per_block,
            running=running, waiting=len(self.registry) - running,
            protocol_version=PROTOCOL_VERSION, model=self.compat.model, draining=self.registry.draining,
            transport=self.compat.transport, prefill_tokens_per_s=self.deps.engine.prefill_rate(),
            pool_free_blocks=pool_free, pool_total_blocks=pool_total,
        )

    def server_load(self, http_port: int) -> kpb.ServerLoad:
        """KvEvents.GetLoad: ready unless draining; live sessions; KV blocks; our HTTP port."""
        draining = self.registry.draining
        free = self.engine.num_free_blocks()
        return kpb.ServerLoad(ready=not draining, not_ready_reason="draining" if draining else "",
                              in_flight=len(self.registry), num_requests=self.engine.num_requests(),
                              kv_blocks_free=free, kv_blocks_total=self.engine.num_blocks, http_port=http_port)

    async def counts(self) -> dict:
        """For /health and the failure tests: everything that must return to zero."""
        stats = await self.engine.stats()  # read on the engine thread
        return {
            "sessions": len(self.registry),
            "session_stages": self.registry.stage_counts(),
            "engine_requests": stats["num_requests"],
            "kv_blocks_total": stats["num_blocks"],
            "kv_blocks_free": stats["num_free_blocks"],
            "kv_blocks_used": stats["num_blocks"] - stats["num_free_blocks"],
            "swapped_requests": self.engine.swapped()[0],  # evicted to host memory (lso.py)
            "cachestore": merged_stats(self.receiver, self.deps.ranks.all_receivers if self.deps.ranks else []),
            "kv_push": self.deps.ranks.state() if self.deps.ranks is not None else None,
            "draining": self.registry.draining,
            **({"kv_pool": self.pool.stats()} if self.pool is not None else {}),
        }
