"""The decode server's assembly: its parts built and started in order, each given only the values it
uses, and stopped in reverse (``cli.serve``: parse -> build -> run -> drain).

``start(args)`` is the one function that reads the parsed flags; the engine's builder
(``server_setup.build_server_engine``) takes them whole. In start order:

1. **metrics** - ServerMetrics for role "decode" (its settings from the environment).
2. **engine** - model, engine and KV pool from the engine flags; the metrics follow its prefix
   cache hits and KV tiers; a KvEventPublisher (--block-size) is attached before the engine thread
   starts (it calls on that thread); then the engine starts.
0. **TLS** - --tls-cert/--tls-key/--tls-ca read and checked (``pdserve/tls.py``), before anything
   loads: with them the receiver, the gRPC port and the KV pool's connections are mutual TLS.
3. **receiver** - the CacheStoreReceiver on the engine's KV pool (region, layout, compat):
   --transfer, listening on --host:--kv-port, advertising --advertise-host, --kv-checksum
   required or not, the TLS files; a checksum mismatch counts in the metrics. Started. With the per-rank
   push (``ServerParts.rank_parts``, --kv-push per-rank) the rank receivers too: one per rank on its pool,
   on --kv-rank-ports in order, default --kv-port + 1 + r, checked before the model loads (``rank_ports.py``,
   ``start_rank_receivers``; at size 1 the receiver itself), and head slices' receivers made at first use.
4. **KV pool** (only with --kv-pool) - DecodePool: the engine, our id in the ledger
   (--kv-pool-instance-id, default the advertised host:--kv-pool-port), the gManager (--kv-pool),
   --host:--kv-pool-port for its KVLender, --kv-pool-lend-fraction, and the receiver (lenders take a
   pooled request's KV from the prefill through it: after the receiver). Started; the metrics
   follow its counters.
5. **service** - ``build_service``: the SessionRegistry; SessionMetrics (the metrics, KV bytes per
   block); unless --no-eviction, the LsoController (the metrics), run by the engine after every
   step; the DecodeEngine adapter (engine, the engine's sampling type, SessionMetrics, the
   LsoController); SessionDeps (those, the receiver, the compat message, model length,
   --session-timeout, the engine's out-of-blocks type, the pool); the DecodeService over the
   engine, SessionDeps and KV bytes per block (the tests build theirs with the same function). The
   metrics track its registry's load (--block-size).
6. **gRPC** - Decode (the service) and KvEvents (the publisher; GetLoad tells --http-port), on
   --host:--port, with keepalive.
7. **HTTP** - /health, /ready, /debug/requests/{rid}, /debug/threads, /debug/steps (Probes over the service) and
   /metrics, on --host:--http-port. With --step-trace the engine's step records also count the CacheStore's
   bytes received (``follow_steps``), and ``stop`` writes them to its file.
8. The start-up heap settles (gc_pauses), and "decode ready" is logged.

Stop (``DecodeServer``): ``drain`` marks the registry draining (new Starts are refused, /ready
503) and waits --drain-timeout for the live sessions; ``stop`` then stops gRPC, HTTP, the KV pool
(before the receiver: releasing a loan deletes its CacheStore entry), the receiver(s) and the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import grpc
from aiohttp import web

from pdserve import gc_pauses, server_setup, thread_cpu, tls
from pdserve.cachestore import CacheStoreReceiver
from pdserve.engine import AsyncLLMEngine, OutOfBlocksError, SamplingParams
from pdserve.engine.step_trace import StepTrace
from pdserve.kv_events import KvEventPublisher, KvEventsServicer
from pdserve.metrics import EngineLoad, ServerMetrics
from pdserve.defaults import SESSION_TIMEOUT_S
from pdserve.protos import kv_events_pb2_grpc as kpb_grpc
from pdserve.protos import session_pb2 as pb
from pdserve.protos import session_pb2_grpc as pb_grpc
from pdserve.server_setup import (ServerParts, attach_kv_events, build_server_engine, follow_tier_metrics,
                                  head_slice_parts)
from pdserve.test_hooks import TestGates

from .decode_engine import DecodeEngine
from .lso import LsoController
from .rank_ports import PortList, check_free, default_slice_ports, rank_ports
from .rank_receivers import RankReceivers
from .registry import SessionRegistry
from .service import DecodeService
from .session_deps import SessionDeps
from .session_metrics import SessionMetrics

if TYPE_CHECKING:
    from pdserve.engine.server_engine import ServerEngine
    from pdserve.kvpool.decode_pool import DecodePool

log = logging.getLogger("pdserve.decode")

GRPC_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000), ("grpc.keepalive_permit_without_calls", 1),
]


async def start(args: argparse.Namespace) -> DecodeServer:
    """Build and start every part, in the order of the module docstring."""
    tls_files = tls.from_args(args, "pdserve decode")  # before the model loads: a bad file ends it at once
    ports = push_ports(args)  # before the model loads too: a clash or a taken port ends it at once
    metrics = ServerMetrics.from_env(role="decode")
    parts = build_server_engine(args, "decode")
    engine = parts.engine
    kv_events = await start_engine(engine, metrics, args.block_size)
    receiver = await start_receiver(parts, metrics, args.transfer, args.host, args.kv_port, args.advertise_host,
                                    args.kv_checksum, tls_files, same_node=args.kv_same_node != "off")
    ranks = await start_rank_receivers(parts, receiver, metrics, args, tls_files, PortList(ports))
    pool = None
    if args.kv_pool:  # after the receiver: lenders take a pooled request's KV from the prefill through it
        instance_id = args.kv_pool_instance_id or f"{args.advertise_host or args.host}:{args.kv_pool_port}"
        pool = start_pool(engine, receiver, metrics, instance_id=instance_id, gmanager=args.kv_pool, host=args.host,
                          port=args.kv_pool_port, advertise_host=args.advertise_host,
                          lend_fraction=args.kv_pool_lend_fraction, tls_files=tls_files)
    service = build_service(
        engine, receiver, parts.compat_message, sampling_cls=SamplingParams, out_of_blocks_error=OutOfBlocksError,
        max_model_len=parts.max_model_len, kv_bytes_per_block=parts.kv_bytes_per_block,
        free_bytes_per_block=parts.free_bytes_per_block,
        session_timeout_s=args.session_timeout, metrics=metrics, eviction=args.eviction, pool=pool, ranks=ranks,
    )
    trace = follow_steps(engine, receiver)
    track_load(metrics, service, engine, args.block_size)
    grpc_server = await start_grpc(service, kv_events, args.http_port, args.host, args.port, tls_files)
    http_runner = await start_http(Probes(service), metrics, args.host, args.http_port)
    gc_pauses.settle(metrics.gc_full_collection.observe)  # freeze the start-up heap, time full collections
    log.info("decode ready: grpc %s:%d, http %s:%d, kv %s (%s), model %s, %d KV blocks",
             args.host, args.port, args.host, args.http_port, args.kv_port, args.transfer, parts.model_name,
             engine.num_blocks)
    return DecodeServer(engine, receiver, pool, service, http_runner, grpc_server, trace,
                        getattr(args, "step_trace", None), ranks)


def follow_steps(engine: ServerEngine, receiver: CacheStoreReceiver) -> StepTrace | None:
    """With --step-trace: the engine's step records also count the KV bytes the CacheStore received in each
    step (``kv_bytes``: tcp and same-node alike); the trace, or None."""
    trace = getattr(engine, "trace", None)
    if trace is not None:
        trace.probes["kv_bytes"] = receiver.bytes_received
    return trace


def build_service(engine: ServerEngine, receiver: CacheStoreReceiver, compat: pb.Compat, *,
                  sampling_cls: type[SamplingParams], out_of_blocks_error: type[Exception], max_model_len: int,
                  kv_bytes_per_block: int, session_timeout_s: float = SESSION_TIMEOUT_S,
                  metrics: ServerMetrics | None = None,
                  eviction: bool = True, pool: DecodePool | None = None,
                  free_bytes_per_block: int | None = None, ranks: RankReceivers | None = None) -> DecodeService:
    """The DecodeService and the SessionDeps every DecodeSession is given (module docstring, step 5);
    ``kv_bytes_per_block``: all layers, K and V, as the wire moves it; ``free_bytes_per_block``: what a free
    block is worth in the load report (tensor parallelism: one rank's pool, the tightest; default the same);
    ``eviction``: batch requests' KV goes to host memory
    while interactive ones miss their TBT (lso.py)."""
    session_metrics = SessionMetrics(metrics, kv_bytes_per_block)
    lso = None
    if eviction:
        lso = LsoController(metrics)
        if isinstance(engine, AsyncLLMEngine):  # the built-in engine's hook, run on its thread after every step
            engine.after_step = lso
    deps = SessionDeps(
        engine=DecodeEngine(engine, sampling_cls, session_metrics, lso), receiver=receiver, registry=SessionRegistry(),
        metrics=session_metrics, compat=compat, max_model_len=max_model_len, session_timeout_s=session_timeout_s,
        out_of_blocks_error=out_of_blocks_error, pool=pool, gates=TestGates.from_environment(), ranks=ranks,
    )
    return DecodeService(engine, deps, free_bytes_per_block or kv_bytes_per_block)


async def start_engine(engine: ServerEngine, metrics: ServerMetrics, block_size: int) -> KvEventPublisher:
    """The metrics follow the engine's counters; its prefix cache publishes KV events (attached
    before the engine thread starts: it calls on that thread); the engine starts."""
    metrics.follow_counter("prefix_cache_hit_tokens", engine.prefix_hit_tokens)
    metrics.follow_counter("engine_busy", engine.busy_seconds)
    follow_tier_metrics(metrics, engine)
    kv_events = KvEventPublisher(block_size)
    attach_kv_events(engine, kv_events)
    await engine.start()
    return kv_events


async def start_receiver(parts: ServerParts, metrics: ServerMetrics, transport: str, host: str, port: int,
                         advertise_host: str | None, require_checksum: bool,
                         tls_files: tls.TlsFiles | None, same_node: bool = True) -> CacheStoreReceiver:
    """The CacheStore receiver on the engine's KV pool (mutual TLS with ``tls_files``; ``same_node``: its
    pool offered to prefills of this machine), started."""
    receiver = CacheStoreReceiver(parts.region, parts.layout, parts.compat, transport=transport, host=host,
                                  port=port, advertise_host=advertise_host, require_checksum=require_checksum,
                                  tls=tls_files, same_node=same_node,
                                  on_checksum_mismatch=lambda rid, layer: metrics.kv_checksum_mismatches.inc())
    await receiver.start()
    return receiver


def push_ports(args) -> list[int]:
    """The per-rank push receivers' ports (rank_ports.py), checked and free; [] when the push is off."""
    if getattr(args, "kv_push", "gather") != "per-rank" or getattr(args, "engine", "builtin") != "builtin":
        return []
    ranks = getattr(args, "tensor_parallel_size", 1)
    ports = rank_ports(args, ranks)
    check_free(args.host, ports)
    return ports + default_slice_ports(args, ranks)


async def start_rank_receivers(parts: ServerParts, receiver: CacheStoreReceiver, metrics: ServerMetrics, args,
                               tls_files: tls.TlsFiles | None, ports: PortList | None = None) -> RankReceivers | None:
    """The per-rank push's receivers (rank_receivers.py), started: at tensor-parallel size 1 the receiver itself; at
    N one per rank on its pool, on ``ports`` in order (rank_ports.py: --kv-rank-ports, default --kv-port + 1 + r;
    ephemeral when none are left), and a maker of head slices' receivers (the next port each). None when this
    server does not offer the per-rank push (``ServerParts.rank_parts`` empty: --kv-push gather, CUDA)."""
    if not parts.rank_parts:
        return None
    ports = ports or PortList([])
    receivers = [receiver]
    if parts.tensor_parallel_size > 1:
        receivers = []
        for region, layout, compat in parts.rank_parts:
            rank_parts = replace(parts, region=region, layout=layout, compat=compat)
            receivers.append(await start_receiver(rank_parts, metrics, args.transfer, args.host, ports.take(),
                                                  args.advertise_host, args.kv_checksum, tls_files,
                                                  same_node=args.kv_same_node != "off"))

    async def make_slice(rank: int, heads: range):
        """A head slice's staging pool and its receiver (engine/tp/pieces.py), at the first request that needs it."""
        same_node, port = args.kv_same_node != "off", ports.take()
        staged, region, layout, compat = head_slice_parts(parts, rank, heads, shared=same_node)
        try:
            rx = await start_receiver(replace(parts, region=region, layout=layout, compat=compat), metrics,
                                      args.transfer, args.host, port, args.advertise_host, args.kv_checksum, tls_files,
                                      same_node=same_node)
        except OSError as exc:
            staged.close()
            raise RuntimeError(f"the receiver of KV heads {heads.start}..{heads.stop - 1} of rank {rank} cannot listen "
                               f"on port {port}: {exc.strerror or exc} (give free ports in --kv-rank-ports)") from None
        log.info("per-rank push: KV heads %d..%d of rank %d land in a staging pool of %.1f MiB (port %d)",
                 heads.start, heads.stop - 1, rank, staged.nbytes / 2**20, rx.port)
        return staged, rx

    assert parts.kv_landed is not None
    version = parts.compat_message.kv_push
    return RankReceivers(receivers, parts.compat_message.num_kv_heads, parts.kv_landed,
                         make_slice if version >= 2 else None, version)


def start_pool(engine: ServerEngine, receiver: CacheStoreReceiver, metrics: ServerMetrics, *, instance_id: str,
               gmanager: str, host: str, port: int, advertise_host: str | None, lend_fraction: float,
               tls_files: tls.TlsFiles | None = None) -> DecodePool:
    """Our part of the KV pool (--kv-pool), started; called on the event loop (the receiver's inbox
    hands it KV there)."""
    from pdserve.kvpool.decode_pool import DecodePool, ReceiverInbox

    if not isinstance(engine, AsyncLLMEngine):  # cli.run refuses --kv-pool with --engine vllm before this
        raise ValueError(f"--kv-pool needs the built-in engine, not {type(engine).__name__}")
    pool = DecodePool(engine, instance_id, gmanager, host, port, advertise_host, lend_fraction,
                      inbox=ReceiverInbox(receiver, asyncio.get_running_loop()), gates=TestGates.from_environment(),
                      tls=tls_files)
    pool.start()
    metrics.follow_counter("kv_pool_pooled_requests", lambda: pool.stats()["pooled_requests_total"])
    metrics.follow_counter("kv_pool_borrowed_blocks", lambda: pool.stats()["borrowed_blocks_total"])
    metrics.follow_gauge("kv_pool_lent_blocks", lambda: pool.stats()["lent_blocks"])
    return pool


def track_load(metrics: ServerMetrics, service: DecodeService, engine: ServerEngine, block_size: int) -> None:
    """The metrics' load: the service's waiting and running sessions, the engine's KV blocks."""
    registry = service.registry
    metrics.track_load(lambda: EngineLoad(waiting=registry.waiting(), running=registry.running(),
                                          kv_blocks_total=engine.num_blocks, kv_blocks_free=engine.num_free_blocks(),
                                          block_size=block_size))


async def start_grpc(service: DecodeService, kv_events: KvEventPublisher, http_port: int, host: str,
                     port: int, tls_files: tls.TlsFiles | None = None) -> grpc.aio.Server:
    """Decode (Session, GetLoadReport) and KvEvents (GetLoad tells ``http_port``), on host:port (mutual TLS
    with ``tls_files``)."""
    server = grpc.aio.server(options=GRPC_OPTIONS)
    pb_grpc.add_DecodeServicer_to_server(service, server)
    kpb_grpc.add_KvEventsServicer_to_server(KvEventsServicer(kv_events, lambda: service.server_load(http_port)), server)
    tls.add_port(server, f"{host}:{port}", tls_files)
    await server.start()
    return server


async def start_http(probes: Probes, metrics: ServerMetrics, host: str, port: int) -> web.AppRunner:
    """The probes' routes and /metrics, on host:port."""
    app = web.Application()
    app.router.add_get("/debug/requests/{rid}", probes.debug_request)
    app.router.add_get("/debug/threads", probes.debug_threads)
    app.router.add_get("/debug/steps", probes.debug_steps)
    app.router.add_get("/health", probes.health)
    app.router.add_get("/ready", probes.ready)
    app.router.add_get("/metrics", metrics.aiohttp_handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


@dataclass(slots=True)
class Probes:
    """/health (the service's counts), /ready (not draining), /debug/requests/{rid} (a request's
    recent layer arrivals) and /debug/threads (each thread's CPU seconds)."""

    service: DecodeService

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "role": "decode", **(await self.service.counts())})

    async def ready(self, request: web.Request) -> web.Response:
        ok = not self.service.registry.draining
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    async def debug_request(self, request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        arrivals = self.service.registry.arrivals.get(rid)
        if arrivals is None:
            return web.json_response({"error": f"unknown request {rid!r}"}, status=404)
        return web.json_response({"request_id": rid, "layer_arrived": arrivals})

    async def debug_threads(self, request: web.Request) -> web.Response:
        """Each thread's CPU seconds so far and the process's (thread_cpu.snapshot)."""
        return web.json_response(thread_cpu.snapshot())

    async def debug_steps(self, request: web.Request) -> web.Response:
        """The engine's step records (--step-trace: engine/step_trace.py); 404 without it."""
        trace = getattr(self.service.engine, "trace", None)
        if trace is None:
            return web.json_response({"error": "no step trace: start the decode with --step-trace FILE"}, status=404)
        return web.json_response({"steps": trace.records()})


@dataclass(slots=True)
class DecodeServer:
    """The started parts, for the drain and the stop."""

    engine: ServerEngine
    receiver: CacheStoreReceiver
    pool: DecodePool | None
    service: DecodeService
    http_runner: web.AppRunner
    grpc_server: grpc.aio.Server
    trace: StepTrace | None = None  # --step-trace: written to trace_path at stop
    trace_path: str | None = None
    ranks: RankReceivers | None = None  # the per-rank push's receivers (the receiver itself at size 1)

    async def drain(self, sig: str, timeout_s: float) -> None:
        """New Starts refused (/ready 503), then up to ``timeout_s`` for the live sessions."""
        registry = self.service.registry
        log.info("%s: draining %d session(s)", sig, len(registry))
        registry.draining = True
        left = await server_setup.drain(lambda: len(registry), timeout_s)
        if left:
            log.warning("stopping with %d session(s) still open", left)

    async def stop(self) -> None:
        await self.grpc_server.stop(grace=1.0)
        await self.http_runner.cleanup()
        if self.pool is not None:  # before the receiver: releasing a loan deletes its CacheStore entry
            await asyncio.to_thread(self.pool.stop)
        await self.receiver.stop()
        for rank_receiver in self.ranks.all_receivers if self.ranks is not None else []:
            if rank_receiver is not self.receiver:
                await rank_receiver.stop()
        for staged, _ in self.ranks.slices.values() if self.ranks is not None else []:
            staged.close()  # a staging pool's memfd (the mapping goes with the tensor)
        await self.engine.stop()
        if self.trace is not None:
            self.trace.close()
            if self.trace_path:
                n = await asyncio.to_thread(self.trace.dump, self.trace_path)
                log.info("step trace: %d steps written to %s", n, self.trace_path)
