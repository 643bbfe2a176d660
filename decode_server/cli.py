"""Run a decode server: receives KV from prefill, continuous-batch decodes, streams tokens back.

Serves gRPC ``Decode.Session`` (one bidirectional stream per request) and
``Decode.GetLoadReport`` on --port, the CacheStore receiver (tcp listener or nixl agent)
on --kv-port, ``KvEvents`` (its prefix cache as a snapshot then numbered events, for the
prefills' decode pickers) on --port too, with --kv-pool the KV pool's KVLender on
--kv-pool-port (blocks lent to peers; kvpool/decode_pool.py), and HTTP /health (JSON:
sessions, KV blocks, CacheStore entries, the pool's loans), /ready and /metrics on
--http-port. SIGTERM/SIGINT: stop admitting (draining, refusals say so), let live sessions
finish for --drain-timeout seconds, then stop.

Request lifecycle on decode: see decode_server/session.py (admit -> allocate (reusing the
prompt's cached prefix when prefill asks) -> transfer, or compute the prompt here -> decode ->
release).
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from pdserve import defaults, gc_pauses
from pdserve.server_setup import (add_server_arguments, attach_kv_events, build_server_engine, drain,
                                  ensure_engine_environment, follow_tier_metrics, setup_logging, wait_for_stop_signal)

log = logging.getLogger("pdserve.decode")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser, drains="live sessions")
    parser.add_argument("--port", type=int, default=defaults.DECODE_GRPC_PORT, help="gRPC port (Session, load reports)")
    parser.add_argument("--http-port", type=int, default=defaults.DECODE_HTTP_PORT, help="HTTP port (/health /ready /metrics)")
    parser.add_argument("--kv-port", type=int, default=defaults.KV_TRANSFER_PORT, help="CacheStore receiver port")
    parser.add_argument("--advertise-host", default=None, help="host prefill should send KV to (default: --host)")
    parser.add_argument("--no-eviction", dest="eviction", action="store_false",
                        help="never evict a batch request's KV to host memory while an interactive request misses "
                             "its TBT target (on by default; it acts only for requests of SLO classes: a class with "
                             "a tbtMs target is protected, one with neither ttftMs nor tbtMs may be evicted)")
    p = parser.add_argument_group("KV pool (DistKV-LLM; off unless --kv-pool)")
    p.add_argument("--kv-pool", default="", metavar="GMANAGER",
                   help="host:port of the KV pool's gManager: lend free KV blocks to peer decodes, and borrow theirs "
                        "for a (greedy) request too big for our free blocks")
    p.add_argument("--kv-pool-port", type=int, default=defaults.KV_POOL_PORT, help="KVLender gRPC port (lent blocks)")
    p.add_argument("--kv-pool-lend-fraction", type=_fraction, default=0.5,
                   help="at most this fraction of our KV blocks is lent to peers (the rest stays for our own requests)")
    p.add_argument("--kv-pool-instance-id", default=None,
                   help="our name in the pool's ledger (default: the advertised host:--kv-pool-port)")


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be within [0, 1], got {text}")
    return value


def run(args: argparse.Namespace) -> int:
    ensure_engine_environment(args)
    setup_logging(args.log_level, "decode")
    return asyncio.run(serve(args))


async def serve(args: argparse.Namespace) -> int:
    import grpc
    from aiohttp import web

    from pdserve.cachestore import CacheStoreReceiver
    from pdserve.engine import OutOfBlocksError, SamplingParams
    from pdserve.kv_events import KvEventPublisher, KvEventsServicer
    from pdserve.metrics import EngineLoad, ServerMetrics
    from pdserve.protos import kv_events_pb2_grpc as kpb_grpc
    from pdserve.protos import session_pb2_grpc as pb_grpc

    from .service import DecodeService

    metrics = ServerMetrics.from_env(role="decode")
    parts = build_server_engine(args, "decode")
    engine = parts.engine
    metrics.follow_counter("prefix_cache_hit_tokens", engine.prefix_hit_tokens)
    follow_tier_metrics(metrics, engine)
    kv_events = KvEventPublisher(args.block_size)
    attach_kv_events(engine, kv_events)  # before the engine thread starts; it calls on that thread
    await engine.start()
    receiver = CacheStoreReceiver(parts.region, parts.layout, parts.compat, transport=args.transfer, host=args.host,
                                  port=args.kv_port, advertise_host=args.advertise_host,
                                  require_checksum=args.kv_checksum,
                                  on_checksum_mismatch=lambda rid, layer: metrics.kv_checksum_mismatches.inc())
    await receiver.start()
    pool = None
    if args.kv_pool:  # after the receiver: lenders take a pooled request's KV from the prefill through it
        from pdserve.kvpool.decode_pool import DecodePool, ReceiverInbox

        host = args.advertise_host or args.host
        pool = DecodePool(engine, args.kv_pool_instance_id or f"{host}:{args.kv_pool_port}", args.kv_pool, args.host,
                          args.kv_pool_port, args.advertise_host, args.kv_pool_lend_fraction,
                          inbox=ReceiverInbox(receiver, asyncio.get_running_loop()))
        pool.start()
        metrics.follow_counter("kv_pool_pooled_requests", lambda: pool.stats()["pooled_requests_total"])
        metrics.follow_counter("kv_pool_borrowed_blocks", lambda: pool.stats()["borrowed_blocks_total"])
        metrics.follow_gauge("kv_pool_lent_blocks", lambda: pool.stats()["lent_blocks"])
    service = DecodeService(
        engine, receiver, parts.compat_message, sampling_cls=SamplingParams, out_of_blocks_error=OutOfBlocksError,
        max_model_len=parts.max_model_len, kv_bytes_per_block=parts.kv_bytes_per_block,
        session_timeout_s=args.session_timeout, metrics=metrics, eviction=args.eviction, pool=pool,
    )
    registry = service.registry
    metrics.track_load(lambda: EngineLoad(waiting=registry.waiting(), running=registry.running(),
                                          kv_blocks_total=engine.num_blocks, kv_blocks_free=engine.num_free_blocks(),
                                          block_size=args.block_size))
    server = grpc.aio.server(options=[
        ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000), ("grpc.keepalive_permit_without_calls", 1),
    ])
    pb_grpc.add_DecodeServicer_to_server(service, server)
    kpb_grpc.add_KvEventsServicer_to_server(KvEventsServicer(kv_events, lambda: service.server_load(args.http_port)), server)
    server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()

    async def health(request):
        return web.json_response({"status": "ok", "role": "decode", **(await service.counts())})

    async def ready(request):
        ok = not service.registry.draining
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    async def debug_request(request):
        rid = request.match_info["rid"]
        arrivals = service.registry.arrivals.get(rid)
        if arrivals is None:
            return web.json_response({"error": f"unknown request {rid!r}"}, status=404)
        return web.json_response({"request_id": rid, "layer_arrived": arrivals})

    app = web.Application()
    app.router.add_get("/debug/requests/{rid}", debug_request)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics.aiohttp_handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.http_port).start()
    gc_pauses.settle(metrics.gc_full_collection.observe)  # freeze the start-up heap, time full collections
    log.info("decode ready: grpc %s:%d, http %s:%d, kv %s (%s), model %s, %d KV blocks",
             args.host, args.port, args.host, args.http_port, args.kv_port, args.transfer, parts.model_name, engine.num_blocks)
    sig = await wait_for_stop_signal()
    log.info("%s: draining %d session(s)", sig, len(service.registry))
    service.registry.draining = True
    left = await drain(lambda: len(service.registry), args.drain_timeout)
    if left:
        log.warning("stopping with %d session(s) still open", left)
    await server.stop(grace=1.0)
    await runner.cleanup()
    if pool is not None:  # before the receiver: releasing a loan deletes its CacheStore entry
        await asyncio.to_thread(pool.stop)
    await receiver.stop()
    await engine.stop()
    return 0
