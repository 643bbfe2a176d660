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

Start-up: ``run`` sets up the environment and logging, ``serve`` starts the parts (``wiring.py``
says in which order and what each is given), serves until SIGTERM/SIGINT, drains and stops them.
"""

from __future__ import annotations

import argparse
import asyncio

from pdserve import defaults
from pdserve.server_setup import add_server_arguments, ensure_engine_environment, setup_logging, wait_for_stop_signal

from .rank_ports import parse_ports


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser, drains="live sessions")
    parser.add_argument("--port", type=int, default=defaults.DECODE_GRPC_PORT, help="gRPC port (Session, load reports)")
    parser.add_argument("--http-port", type=int, default=defaults.DECODE_HTTP_PORT,
                        help="HTTP port (/health /ready /metrics)")
    parser.add_argument("--kv-port", type=int, default=defaults.KV_TRANSFER_PORT, help="CacheStore receiver port")
    parser.add_argument("--kv-rank-ports", type=parse_ports, default=None, metavar="PORTS",
                        help="ports of the per-rank KV push's receivers, comma-separated ports and ranges A-B, used in "
                             "order: one per tensor-parallel rank, then one per head slice as each is first needed "
                             "(later slices: free ports). Default: --kv-port + 1 + rank. Checked at start: no port "
                             "twice, none of the server's own, each free")
    parser.add_argument("--advertise-host", default=None, help="host prefill should send KV to (default: --host)")
    parser.add_argument("--no-eviction", dest="eviction", action="store_false",
                        help="never evict a batch request's KV to host memory while an interactive request misses "
                             "its TBT target (on by default; it acts only for requests of SLO classes: a class with "
                             "a tbtMs target is protected, one with neither ttftMs nor tbtMs may be evicted)")
    parser.add_argument("--tbt-slo-ms", type=_positive_ms, default=0.0, metavar="MS",
                        help="a time-between-tokens bound: a request is allocated (and, once its KV is in, joins the "
                             "running batch) only while the step time predicted for it (fitted online to this decode's "
                             "own steps, by batch size and context) stays within MS; others are refused for now (code "
                             "tbt_bound: the prefill waits and asks again) or wait, their KV held, and join as others "
                             "finish. A request alone always runs. Default: no bound (built-in and sim engines)")
    parser.add_argument("--step-trace", default=None, metavar="FILE",
                        help="debug: record what happened in and just before every engine step (the batch, requests "
                             "joining, KV arriving, Python collections, other threads' CPU: engine/step_trace.py) and "
                             "write the records to FILE (JSON lines) when the decode stops; also GET /debug/steps")
    p = parser.add_argument_group("KV pool (DistKV-LLM; off unless --kv-pool)")
    p.add_argument("--kv-pool", default="", metavar="GMANAGER",
                   help="host:port of the KV pool's gManager: lend free KV blocks to peer decodes, and borrow theirs "
                        "for a (greedy) request too big for our free blocks")
    p.add_argument("--kv-pool-port", type=int, default=defaults.KV_POOL_PORT, help="KVLender gRPC port (lent blocks)")
    p.add_argument("--kv-pool-lend-fraction", type=_fraction, default=0.5,
                   help="at most this fraction of our KV blocks is lent to peers (the rest stays for our own requests)")
    p.add_argument("--kv-pool-instance-id", default=None,
                   help="our name in the pool's ledger (default: the advertised host:--kv-pool-port)")


def _positive_ms(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of milliseconds, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be within [0, 1], got {text}")
    return value


def run(args: argparse.Namespace) -> int:
    if args.kv_pool and getattr(args, "engine", "builtin") != "builtin":
        raise SystemExit(f"pdserve decode: --kv-pool needs the built-in engine: --engine {args.engine} "
                         "cannot lend or borrow KV blocks")
    if (args.tbt_slo_ms or args.step_trace) and getattr(args, "engine", "builtin") == "vllm":
        raise SystemExit("pdserve decode: --tbt-slo-ms and --step-trace need the built-in (or sim) engine, not "
                         "--engine vllm")
    ensure_engine_environment(args)
    setup_logging(args.log_level, "decode")
    return asyncio.run(serve(args))


async def serve(args: argparse.Namespace) -> int:
    """Start the parts (``wiring.py``), serve until SIGTERM/SIGINT, drain, stop."""
    from .wiring import start

    server = await start(args)
    sig = await wait_for_stop_signal()
    await server.drain(sig, args.drain_timeout)
    await server.stop()
    return 0
