"""Serve the OpenAI Batch API in throughput mode: batch lines run on pipeline stages (TD-Pipe).

Examples:
  pdserve batch-server --port 8000 --batch-db jobs.sqlite                   # 2 stages, TD-Pipe
  pdserve batch-server --port 8000 --batch-db jobs.sqlite --schedule mixed --pipeline-stages 2

The same routes, database and guarantees as a prefill's Batch API (``api.py``,
docs/batch.md: /v1/files, /v1/batches, restart resumes every unfinished job and finishes
each line exactly once), with no online traffic on this server: its lines are not requests
through the admission queue but sequences of one ``PipelineEngine`` (``pipeline_service.py``),
up to ``--batch-max-in-flight`` at once (default: ``--max-num-seqs``), so TD-Pipe sees whole
batches. Online serving stays on prefill/decode servers, where batch lines (when a prefill
runs them) go through the lowest SLO class. ``GET /health`` and ``/ready``: the executor's
state and the runner's (lines in flight, lines run). With --api-key-file every other route needs
one of its keys (``pdserve.http_auth``; this server has no /metrics, so nothing is counted per key).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from pdserve import defaults, http_auth
from pdserve.server_setup import setup_logging, wait_for_stop_signal

from .pipeline.cli import add_engine_arguments
from .pipeline.config import PipelineConfig

log = logging.getLogger("pdserve.batch_server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=defaults.HTTP_PORT)
    parser.add_argument("--batch-db", default=defaults.BATCH_DB, help="SQLite database of batch jobs and files "
                        f"(default: {defaults.BATCH_DB}); unfinished jobs resume from it after a restart")
    parser.add_argument("--batch-max-in-flight", type=int, default=None,
                        help="lines in the pipeline engine at once (default: --max-num-seqs)")
    parser.add_argument("--batch-max-file-bytes", type=int, default=defaults.BATCH_MAX_FILE_BYTES)
    parser.add_argument("--log-level", default="info")
    http_auth.add_arguments(parser)
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, "batch-server")
    if args.pipeline_stages < 2:
        raise SystemExit(f"pdserve batch-server: --pipeline-stages must be >= 2, got {args.pipeline_stages}")
    for flag in ("batch_max_in_flight", "batch_max_file_bytes"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise SystemExit(f"pdserve batch-server: --{flag.replace('_', '-')} must be > 0, got {value}")
    if not args.batch_db:
        raise SystemExit("pdserve batch-server: --batch-db must name a database file")
    door = http_auth.Door.from_args(args, "pdserve batch-server")
    return asyncio.run(_serve(args, door))


async def _serve(args, door: http_auth.Door) -> int:
    from aiohttp import web

    from .api import BatchService
    from .pipeline_service import PipelineExecutor
    from .runner import BatchRunner, StoreThread
    from .store import BatchStore, StoreInUse

    cfg = PipelineConfig(num_stages=args.pipeline_stages, schedule=args.schedule, num_blocks=args.num_blocks,
                         block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         long_prefill_threshold=args.long_prefill_threshold, threads_per_stage=args.threads,
                         device=args.device, dtype=args.dtype, micro_batches=args.micro_batches,
                         min_decode_batch=args.min_decode_batch)
    try:
        store = StoreThread(BatchStore(os.path.expanduser(args.batch_db)))
    except StoreInUse as exc:
        raise SystemExit(f"pdserve batch-server: {exc}") from None
    try:
        executor = PipelineExecutor(args.model, cfg)
        await executor.start()
    except Exception as exc:
        store.close()
        raise SystemExit(f"pdserve batch-server: the pipeline engine did not start: {exc}") from None
    runner = BatchRunner(store, executor.execute, args.batch_max_in_flight or args.max_num_seqs)
    runner.start()
    service = BatchService(store, runner, args.batch_max_file_bytes)
    app = web.Application()
    service.add_routes(app)

    async def health(_request):
        return web.json_response({"status": "ok", "batch": {"on": True, **runner.state()}, **executor.state()})

    app.router.add_get("/health", health)
    app.router.add_get("/ready", health)
    door.install(app)  # no /metrics here: its requests are not counted per key
    web_runner = web.AppRunner(app, handler_cancellation=True)
    await web_runner.setup()
    await web.TCPSite(web_runner, args.host, args.port).start()
    log.info("batch server ready: http %s:%d, database %s, %d pipeline stages, schedule %s, %d line(s) at once, %s",
             args.host, args.port, args.batch_db, args.pipeline_stages, args.schedule, runner.max_in_flight,
             door.describe())
    sig = await wait_for_stop_signal()
    log.info("%s: stopping (lines in flight stay pending and run after a restart)", sig)
    await runner.stop()
    await executor.stop()
    await web_runner.cleanup()
    store.close()
    return 0
