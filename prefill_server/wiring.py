"""The prefill server's assembly: its parts built and started in order, each given only the values it
uses, and stopped in reverse (``cli.serve``: parse -> build -> run -> drain).

``start(args, discovery, slo)`` is the one function that reads the parsed flags; the engine's
builder (``server_setup.build_server_engine``) and the Batch API's (``BatchService.start``) take
them whole. In start order:

0. **TLS** - --tls-cert/--tls-key/--tls-ca read and checked (``pdserve/tls.py``), before anything
   loads: with them the sender's links, the poller's channels to the decodes (Sessions, load
   reports, KV events) and the gRPC port are mutual TLS.
1. **metrics** - ServerMetrics for role "prefill" (its settings from the environment).
2. **engine** - model, engine and KV pool from the engine flags; the metrics follow its prefix
   cache hits, KV tiers and computed prompt tokens; a KvEventPublisher (--block-size) is attached
   before the engine thread starts (it calls on that thread); then the engine starts.
3. **sender** - the CacheStoreSender on the engine's KV pool (region, layout, compat): --transfer,
   --scheduler, --kv-checksum, --session-timeout as its stall timer; started. With the per-rank push
   (``ServerParts.rank_parts``, --kv-push per-rank) one more per rank on its pool (``start_rank_senders``;
   at size 1 the sender itself), handed to the SessionRunner.
4. **routing** - the DecodePicker (--policy, --load-report-expiry); the SLO GlobalQueue (the SLO
   classes, --queue-policy, the metrics, the decodes' KV blocks the picker knows); a DecodeIndex
   with --decode-reuse; the AdmissionQueue (--max-queued-requests, --queue-timeout, the metrics'
   queued gauge, the SLO queue); the LoadReportPoller (the discovery, the picker,
   --load-report-interval, --decode-leave-grace (default --request-timeout), the index; each
   report wakes the admission queue). Not started yet.
5. **node** - ``build_node``: the Disaggregator (--disaggregation, the picker, the KV facts,
   --layerwise-push, the KV events' held prefix, the metrics), the SessionRunner (its
   SessionConfig: compat, --block-size, the tokenizer's EOS ids, --session-timeout,
   --connect-timeout, --layerwise-push, the engine's out-of-blocks type, --decode-reuse,
   --max-num-batched-tokens as the line's room; the poller's stubs, the engine, the sender, the
   registry of open Sessions, TransferAccounting as its observer), the LocalFallback (--local-fallback), and the
   PrefillNode that holds them: its ``ConductorDeps`` (what each request's conductor is given: the
   engine, the picker, the admission queue, the SessionRunner, the local fallback, the routing flags
   --max-attempts, --resume, --resume-wait, the DecodeIndex with --decode-reuse, the metrics; the
   hooks ``wake_line`` and ``keep_latest``) and the Disaggregator. With an ordering policy
   (--queue-policy edf or qlm) the admission line holds a request while our engine's own line
   (the remote prefills not computed yet) holds a step's budget of prompt tokens
   (--max-num-batched-tokens), and each prompt computed wakes the line's head, so the policy (not
   arrival order) picks who the engine computes next; the SLO queue's plans then count this prefill's one
   engine besides the decodes' KV blocks (``prefill_bound``). The tests build their nodes with the same function.
6. **frontend** - Frontend: node, tokenizer, model name and length, vocabulary size, metrics,
   --request-timeout, SLO queue.
7. **probes** - Probes: /health, KvEvents' GetLoad and the metrics' load, read from the parts
   (the metrics track its load from now on).
8. **discovery, poller** - started: load reports begin.
9. **Batch API** - BatchService (``pdserve.batch.api``) from the --batch-* flags and the frontend
   (resumes unfinished jobs).
10. **HTTP** - HttpApi's routes (frontend, probes, metrics) + the Batch API's + GET /tokenizer
    (--model), behind the API keys (``pdserve.http_auth.Door``: every route but /health, /ready and
    /metrics; requests counted per key in the metrics), on --host:--port.
11. **gRPC** - Generate (frontend) and KvEvents (the publisher, the probes' load), on
    --host:--grpc-port.
12. The start-up heap settles (gc_pauses), and "prefill ready" is logged.

Stop (``PrefillServer``): ``drain`` turns /ready 503, stops the Batch API (lines in flight stay
pending in its database) and waits --drain-timeout for the requests in flight; ``stop`` then
stops gRPC, HTTP, the poller, the discovery, the sender and the engine, in that order.
"""

from __future__ import annotations

import argparse
import functools
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

import grpc
from aiohttp import web

from pdserve import defaults, gc_pauses, server_setup, test_hooks, tls
from pdserve.batch.api import BatchService
from pdserve.cachestore import CacheStoreSender
from pdserve.engine import OutOfBlocksError, SamplingParams
from pdserve.http_auth import Door
from pdserve.kv_events import KvEventPublisher, KvEventsServicer
from pdserve.metrics import EngineLoad, ServerMetrics
from pdserve.protos import generate_pb2_grpc as gpb_grpc
from pdserve.protos import kv_events_pb2 as kpb
from pdserve.protos import kv_events_pb2_grpc as kpb_grpc
from pdserve.protos import session_pb2 as pb
from pdserve.server_setup import (ServerParts, attach_kv_events, build_server_engine, follow_tier_metrics,
                                  head_slice_parts, merged_stats)
from pdserve.slo import GlobalQueue

from . import tokenize_api, tokenizer_api
from .admission_queue import AdmissionQueue
from .conductor_deps import ConductorDeps
from .decode_index import DecodeIndex
from .decode_session import SessionConfig, SessionRunner, SessionTimings
from .disaggregator import Disaggregator
from .frontend import Frontend
from .grpc_api import GenerateServicer
from .http_api import HttpApi
from .load_poller import LoadReportPoller
from .local_fallback import LocalFallback
from .node import PrefillNode, keep_latest, wake_line
from .picker import DecodePicker
from .rank_senders import RankSenders
from .transfer_accounting import TransferAccounting

if TYPE_CHECKING:
    from pdserve.discovery import FileDiscovery, KubernetesDiscovery, StaticDiscovery
    from pdserve.engine.server_engine import ServerEngine
    from pdserve.slo import SloClasses

    Discovery = StaticDiscovery | FileDiscovery | KubernetesDiscovery

log = logging.getLogger("pdserve.prefill")


async def start(args: argparse.Namespace, discovery: Discovery, slo: SloClasses, door: Door) -> PrefillServer:
    """Build and start every part, in the order of the module docstring; ``slo``: the SLO classes
    (--slo-classes, loaded and checked by ``cli.run``); ``door``: the API keys (--api-key-file,
    --metrics-key-file, read by ``cli.run``)."""
    tls_files = tls.from_args(args, "pdserve prefill")  # before the model loads: a bad file ends it at once
    metrics = ServerMetrics.from_env(role="prefill")
    parts = build_server_engine(args, "prefill")
    engine, loaded = parts.engine, parts.loaded
    kv_events = await start_engine(engine, metrics, args.block_size)
    sender = await start_sender(parts, args.transfer, args.scheduler, args.kv_checksum, args.session_timeout,
                                tls_files, same_node=args.kv_same_node)
    ranks = await start_rank_senders(parts, sender, args, tls_files)
    picker = DecodePicker(policy=args.policy, expiry_s=args.load_report_expiry)
    slo_queue = make_slo_queue(slo, args.queue_policy, metrics, picker)
    decode_index = DecodeIndex() if args.decode_reuse else None
    queue = AdmissionQueue(args.max_queued_requests, max_wait_s=args.queue_timeout,
                           on_length=metrics.requests_queued.set, slo=slo_queue)
    leave_grace = args.request_timeout if args.decode_leave_grace is None else args.decode_leave_grace
    poller = LoadReportPoller(discovery, picker, interval_s=args.load_report_interval, close_grace_s=leave_grace,
                              on_update=lambda: metrics.known_decodes.set(len(picker.eligible())), index=decode_index,
                              on_report=lambda address: queue.notify(),  # a fresh report may show freed blocks
                              tls=tls_files)
    node = build_node(
        engine, sender, picker, poller, queue, parts.compat_message, block_size=args.block_size,
        kv_bytes_per_block=parts.kv_bytes_per_block, eos_token_ids=tuple(loaded.tokenizer.eos_token_ids),
        max_attempts=args.max_attempts, local_fallback=args.local_fallback, resume=args.resume,
        resume_wait_s=args.resume_wait, session_timeout_s=args.session_timeout,
        connect_timeout_s=args.connect_timeout, layerwise_push=args.layerwise_push,
        line_tokens=args.max_num_batched_tokens, decode_reuse=args.decode_reuse, decode_index=decode_index,
        disaggregation=args.disaggregation, held_prefix=kv_events.leading, out_of_blocks_error=OutOfBlocksError,
        metrics=metrics, ranks=ranks,
    )
    frontend = Frontend(node, loaded.tokenizer, SamplingParams, parts.model_name, parts.max_model_len, metrics,
                        loaded.config.vocab_size, request_timeout_s=args.request_timeout, slo=slo_queue)
    probes = Probes(node, frontend, engine, sender, picker, discovery, decode_index, slo_queue, http_port=args.port,
                    block_size=args.block_size, ranks=ranks)
    metrics.track_load(probes.engine_load)
    await discovery.start()
    await poller.start()
    probes.batch = batch = BatchService.start(args, frontend)  # resumes unfinished batch jobs
    http_runner = await start_http(frontend, probes, batch, metrics, args.model, args.host, args.port,
                                   door.counted_by(metrics))
    grpc_server = await start_grpc(frontend, kv_events, probes.load, args.host, args.grpc_port, tls_files)
    gc_pauses.settle(metrics.gc_full_collection.observe)  # freeze the start-up heap, time full collections
    log.info("prefill ready: http %s:%d, grpc %s:%d, decodes %s, policy %s, transfer %s, local fallback %s, "
             "decode reuse %s, disaggregation %s, queue %s, SLO classes %s", args.host, args.port, args.host,
             args.grpc_port, discovery.addresses() or "(none yet)", args.policy, args.transfer,
             "on" if args.local_fallback else "off", "on" if args.decode_reuse else "off", args.disaggregation,
             args.queue_policy, "; ".join(c.describe() for c in slo))
    log.info("HTTP door: %s", door.describe())
    return PrefillServer(engine, sender, discovery, poller, frontend, probes, http_runner, grpc_server, ranks)


def build_node(engine: ServerEngine, sender: CacheStoreSender, picker: DecodePicker,
               poller: LoadReportPoller, queue: AdmissionQueue, compat: pb.Compat, *, block_size: int,
               kv_bytes_per_block: int, eos_token_ids: tuple[int, ...] = (), max_attempts: int = 3,
               local_fallback: bool = False, resume: bool = True, resume_wait_s: float = defaults.RESUME_WAIT_S,
               session_timeout_s: float = defaults.SESSION_TIMEOUT_S, connect_timeout_s: float = 5.0,
               layerwise_push: bool = True, line_tokens: int = 2048, decode_reuse: bool = True,
               decode_index: DecodeIndex | None = None, disaggregation: str = defaults.DISAGGREGATION,
               held_prefix: Callable[[list[int]], int] | None = None,
               out_of_blocks_error: type[Exception] = RuntimeError,
               metrics: ServerMetrics | None = None, ranks: RankSenders | None = None) -> PrefillNode:
    """The PrefillNode with the parts it holds for every request (module docstring, step 5): each
    part given only what it uses. ``poller`` already wakes ``queue`` on each report (its
    ``on_report``); ``kv_bytes_per_block``: all layers, K and V; ``held_prefix``: prompt hashes ->
    leading ones our prefix cache holds (the KV events'); ``eos_token_ids``: the tokenizer's."""
    sessions: dict[str, str] = {}  # request id -> decode address, while a Session is open
    disaggregator = Disaggregator(disaggregation, picker=picker, block_size=block_size, num_layers=compat.num_layers,
                                  kv_bytes_per_block=kv_bytes_per_block, layerwise=layerwise_push,
                                  held_prefix=held_prefix, metrics=metrics)
    config = SessionConfig(compat, block_size, eos_token_ids, session_timeout_s, connect_timeout_s, layerwise_push,
                           out_of_blocks_error, reuse_prefix=decode_reuse, line_tokens=line_tokens)
    accounting = TransferAccounting(picker, kv_bytes_per_block, disaggregator, metrics)
    runner = SessionRunner(config, stubs=poller.stub, engine=engine, sender=sender, registry=sessions,
                           observer=accounting, disaggregator=disaggregator,
                           gates=test_hooks.TestGates.from_environment(), ranks=ranks)
    if queue.slo is not None and queue.slo.policy != "fifo":  # the policy orders what enters our engine's line
        queue.room, runner.line.on_room = runner.line.has_room, queue.notify
        queue.slo.prefill_bound = True  # its plans: the decodes' blocks and this one engine, one prompt at a time
    last_timings: dict[str, SessionTimings] = {}
    deps = ConductorDeps(engine, picker, queue, runner, block_size,
                         on_session_end=functools.partial(wake_line, queue, poller),
                         keep_timings=functools.partial(keep_latest, last_timings),
                         max_attempts=max_attempts, resume=resume, resume_wait_s=resume_wait_s,
                         decode_index=decode_index if decode_reuse else None,
                         fallback=LocalFallback(engine, out_of_blocks_error, metrics) if local_fallback else None,
                         metrics=metrics)
    return PrefillNode(deps, disaggregator, sessions, last_timings)


async def start_engine(engine: ServerEngine, metrics: ServerMetrics, block_size: int) -> KvEventPublisher:
    """The metrics follow the engine's counters; its prefix cache publishes KV events (attached
    before the engine thread starts: it calls on that thread); the engine starts."""
    metrics.follow_counter("prefix_cache_hit_tokens", engine.prefix_hit_tokens)
    metrics.follow_counter("engine_busy", engine.busy_seconds)
    follow_tier_metrics(metrics, engine)
    metrics.follow_counter("prompt_tokens_computed", lambda: engine.prefill_counters()[0])
    kv_events = KvEventPublisher(block_size)
    attach_kv_events(engine, kv_events)
    await engine.start()
    return kv_events


async def start_sender(parts: ServerParts, transport: str, scheduler: str, checksum: bool,
                       stall_timeout_s: float, tls_files: tls.TlsFiles | None = None,
                       same_node: str = "auto", corrupt: bool = True) -> CacheStoreSender:
    """The CacheStore sender on the engine's KV pool (mutual TLS with ``tls_files``; ``same_node``: see
    ``CacheStoreSender``), started; ``corrupt``: it takes the corrupt-KV test hook (``test_hooks.corrupt_kv``)."""
    sender = CacheStoreSender(parts.region, parts.layout, parts.compat, transport=transport, scheduler=scheduler,
                              checksum=checksum, stall_timeout_s=stall_timeout_s,
                              corrupt_kv=test_hooks.corrupt_kv() if corrupt else 0,
                              tls=tls_files, link_model=parts.link_model, same_node=same_node)
    await sender.start()
    return sender


async def start_rank_senders(parts: ServerParts, sender: CacheStoreSender, args,
                             tls_files: tls.TlsFiles | None) -> RankSenders | None:
    """The per-rank push's senders (rank_senders.py), started: at tensor-parallel size 1 the sender itself; at N one
    per rank on its pool. None when this server does not offer the per-rank push (``ServerParts.rank_parts`` empty:
    --kv-push gather, CUDA)."""
    if not parts.rank_parts:
        return None
    senders = [sender]
    if parts.tensor_parallel_size > 1:
        senders = []
        last = len(parts.rank_parts) - 1
        for rank, (region, layout, compat) in enumerate(parts.rank_parts):
            rank_parts = replace(parts, region=region, layout=layout, compat=compat)
            senders.append(await start_sender(rank_parts, args.transfer, args.scheduler, args.kv_checksum,
                                              args.session_timeout, tls_files, same_node=args.kv_same_node,
                                              corrupt=rank == last))  # the test hook: one rank's shard fails

    async def make_slice(rank: int, heads: range):
        """A head slice's staging pool and its sender (engine/tp/pieces.py), at the first request that needs it."""
        staged, region, layout, compat = head_slice_parts(parts, rank, heads)
        log.info("per-rank push: KV heads %d..%d of rank %d packed for a decode rank that holds only them "
                 "(a staging pool of %.1f MiB)", heads.start, heads.stop - 1, rank, staged.nbytes / 2**20)
        return staged, await start_sender(replace(parts, region=region, layout=layout, compat=compat), args.transfer,
                                          args.scheduler, args.kv_checksum, args.session_timeout, tls_files,
                                          same_node=args.kv_same_node, corrupt=False)

    cpu = parts.compat_message.kv_push >= 2
    return RankSenders(senders, parts.compat_message.num_kv_heads, make_slice if cpu else None)


def make_slo_queue(slo: SloClasses, policy: str, metrics: ServerMetrics, picker: DecodePicker) -> GlobalQueue:
    """The SLO queue; its plans count the decodes' KV blocks in all, full or not (a decode reserves
    prompt + max_tokens for a request)."""
    return GlobalQueue(slo, policy, metrics,
                       kv_capacity=lambda: sum(load.total_blocks for a in picker.known()
                                               if (load := picker.load(a)) is not None))


async def start_http(frontend: Frontend, probes: Probes, batch: BatchService, metrics: ServerMetrics, model: str,
                     host: str, port: int, door: Door) -> web.AppRunner:
    """OpenAI routes and probes, the Batch API's routes, POST /tokenize and /detokenize, GET /tokenizer (for
    a router that mounts no model: ``model`` is --model), behind ``door``'s API keys, listening on host:port."""
    app = HttpApi(frontend, probes.health, metrics, is_draining=lambda: probes.draining).app()
    door.install(app)
    batch.add_routes(app)
    tokenize_api.add_routes(app, frontend)
    tokenizer_api.add_routes(app, model)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


async def start_grpc(frontend: Frontend, kv_events: KvEventPublisher, load: Callable[[], kpb.ServerLoad], host: str,
                     port: int, tls_files: tls.TlsFiles | None = None) -> grpc.aio.Server:
    """Generate and KvEvents (with GetLoad answered by ``load``), listening on host:port (mutual TLS with
    ``tls_files``)."""
    server = grpc.aio.server()
    gpb_grpc.add_GeneratorServicer_to_server(GenerateServicer(frontend), server)
    kpb_grpc.add_KvEventsServicer_to_server(KvEventsServicer(kv_events, load), server)
    tls.add_port(server, f"{host}:{port}", tls_files)
    await server.start()
    return server


@dataclass(slots=True)
class Probes:
    """What /health shows, what KvEvents' GetLoad answers and the load the metrics read, from the
    live parts; ``draining`` is set by ``PrefillServer.drain``."""

    node: PrefillNode  # its open Sessions, admission queue, local requests, disaggregator, readiness
    frontend: Frontend  # requests in flight
    engine: ServerEngine  # KV blocks
    sender: CacheStoreSender
    picker: DecodePicker
    discovery: Discovery
    decode_index: DecodeIndex | None
    slo_queue: GlobalQueue
    http_port: int  # told to routers in GetLoad
    block_size: int
    ranks: RankSenders | None = None  # the per-rank push's senders (the sender itself at size 1)
    batch: BatchService | None = None  # set once the Batch API started, before the ports open
    draining: bool = False

    def health(self) -> dict:
        node, engine = self.node, self.engine
        kv_free = engine.num_free_blocks()
        return {
            "role": "prefill", "sessions": len(node.sessions), "in_flight": self.frontend.in_flight,
            "queued": len(node.queue), "slo_running": len(self.slo_queue.running),
            "local_requests": node.local_requests, "kv_blocks_total": engine.num_blocks, "kv_blocks_free": kv_free,
            "kv_blocks_used": engine.num_blocks - kv_free,
            "cachestore": merged_stats(self.sender, self.ranks.all_senders if self.ranks is not None else []),
            "kv_push": self.ranks.state() if self.ranks is not None else None,
            "decodes": self.discovery.addresses(), "routable_decodes": self.picker.eligible(),
            "draining": self.draining,
            "decode_index": self.decode_index.state() if self.decode_index is not None else None,
            "disaggregation": node.disaggregator.state(),
            "batch": self.batch.state() if self.batch is not None else None,
        }

    def load(self) -> kpb.ServerLoad:
        ready = self.node.ready() and not self.draining
        reason = "draining" if self.draining else ("" if ready else self.picker.why_none())
        engine = self.engine
        return kpb.ServerLoad(ready=ready, not_ready_reason=reason, in_flight=self.frontend.in_flight,
                              num_requests=engine.num_requests(), kv_blocks_free=engine.num_free_blocks(),
                              kv_blocks_total=engine.num_blocks, http_port=self.http_port, queued=len(self.node.queue))

    def engine_load(self) -> EngineLoad:
        # running: a decode Session open (or decoding locally); waiting: admitted, no decode yet
        running = len(self.node.sessions) + self.node.local_requests
        return EngineLoad(waiting=max(0, self.frontend.in_flight - running), running=running,
                          kv_blocks_total=self.engine.num_blocks, kv_blocks_free=self.engine.num_free_blocks(),
                          block_size=self.block_size)


@dataclass(slots=True)
class PrefillServer:
    """The started parts, for the drain and the stop."""

    engine: ServerEngine
    sender: CacheStoreSender
    discovery: Discovery
    poller: LoadReportPoller
    frontend: Frontend
    probes: Probes
    http_runner: web.AppRunner
    grpc_server: grpc.aio.Server
    ranks: RankSenders | None = None

    async def drain(self, sig: str, timeout_s: float) -> None:
        """/ready 503, the Batch API stopped, then up to ``timeout_s`` for the requests in flight."""
        self.probes.draining = True
        if self.probes.batch is not None:  # lines in flight stay pending in the database; they run after a restart
            await self.probes.batch.stop()
        log.info("%s: draining %d in-flight request(s)", sig, self.frontend.in_flight)
        left = await server_setup.drain(lambda: self.frontend.in_flight, timeout_s)
        if left:
            log.warning("stopping with %d request(s) still in flight", left)

    async def stop(self) -> None:
        await self.grpc_server.stop(grace=1.0)
        await self.http_runner.cleanup()
        await self.poller.stop()
        await self.discovery.stop()
        await self.sender.stop()
        for rank_sender in self.ranks.all_senders if self.ranks is not None else []:
            if rank_sender is not self.sender:
                await rank_sender.stop()
        await self.engine.stop()
