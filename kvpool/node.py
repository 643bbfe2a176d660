"""Run one decode of a KV pool: an engine with a small pool, its rManager, and KVNode.Generate.

The engine's blocks serve this decode's own requests (``pooled=false``: the engine's normal
path; ``pooled=true``: ``PooledRequest``, spilling onto lenders) and are lent to peers
(KVLender) down to ``--reserve`` free blocks. A report thread sends the rManager's row to the
gManager every ``--report-interval`` seconds and right after each loan or release, and frees
loans whose borrower the gManager no longer lists.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from concurrent import futures

import grpc
import torch

from pdserve.defaults import BLOCK_SIZE, BUILTIN_MODEL
from pdserve.engine.errors import OutOfBlocksError
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.loader import load_model
from pdserve.engine.sampling import SamplingParams
from pdserve.protos import kvpool_pb2, kvpool_pb2_grpc

from .pooled import PooledRequest
from .rmanager import BlockLender, Borrower, LenderLost, kv_layout

DEFAULT_RESERVE = 1
DEFAULT_REPORT_INTERVAL_S = 0.3
RPC_TIMEOUT_S = 10.0


class KVNode(kvpool_pb2_grpc.KVNodeServicer):
    def __init__(self, engine: LLMEngine, lock: threading.Lock, lender: BlockLender, borrower: Borrower | None,
                 changed: threading.Event):
        self.engine, self.lock, self.lender, self.borrower, self.changed = engine, lock, lender, borrower, changed
        self.pooled_running = 0

    def Generate(self, request, context):
        ids, n = list(request.prompt_ids), request.max_tokens
        try:
            if request.pooled:
                return self._pooled(request, ids, n)
            return self._normal(request.request_id, ids, n, request.ignore_eos)
        except LenderLost as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except OutOfBlocksError as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finally:
            self.changed.set()

    def _pooled(self, request, ids, n):
        self.pooled_running += 1
        try:
            res = PooledRequest(self.engine, self.lock, self.borrower, RPC_TIMEOUT_S).run(
                request.request_id, ids, n, request.ignore_eos)
        finally:
            self.pooled_running -= 1
        logits = torch.stack(res.logits).numpy().tobytes() if request.return_logits and res.logits else b""
        return kvpool_pb2.GenerateReply(
            token_ids=res.token_ids, logits=logits, local_blocks=res.local_blocks,
            borrowed_blocks=sum(l.blocks for l in res.loans), lenders=[l.lender for l in res.loans],
            prefill_s=res.prefill_s, decode_s=res.decode_s)

    def _normal(self, request_id, ids, n, ignore_eos):
        """The engine's own path (colocated add_request/step), greedy: the reference."""
        sampling = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=ignore_eos)
        tokens, t0 = [], time.perf_counter()
        with self.lock:
            self.engine.add_request(request_id, ids, sampling)
            try:
                while True:
                    outs = [o for o in self.engine.step() if o.request_id == request_id]
                    for out in outs:
                        tokens += out.new_token_ids
                    if any(o.finished for o in outs):
                        break
            finally:
                self.engine.abort(request_id)
        return kvpool_pb2.GenerateReply(token_ids=tokens, local_blocks=0, decode_s=time.perf_counter() - t0)

    def Stats(self, request, context):
        with self.lock:
            return kvpool_pb2.StatsReply(
                num_blocks=self.engine.num_blocks, free_blocks=self.engine.num_free_blocks(),
                loans=len(self.lender.book.loans), lent_blocks=self.lender.book.lent_blocks(),
                engine_requests=self.engine.num_requests(), pooled_requests=self.pooled_running)


class ReportingLender(BlockLender):
    """A BlockLender that wakes the report thread after each loan or release."""

    def __init__(self, *args, changed: threading.Event, **kwargs):
        super().__init__(*args, **kwargs)
        self.changed = changed

    def Lend(self, request, context):
        try:
            return super().Lend(request, context)
        finally:
            self.changed.set()

    def release(self, request_id: str) -> int:
        freed = super().release(request_id)
        self.changed.set()
        return freed


def report_loop(lender: BlockLender, gmanager, instance: str, address: str, interval: float,
                changed: threading.Event, stop: threading.Event) -> None:
    while not stop.is_set():
        changed.clear()
        try:
            reply = gmanager.Report(lender.report(instance, address), timeout=RPC_TIMEOUT_S)
            lender.sweep(set(reply.live_instances))
        except grpc.RpcError:
            lender.sweep(None)  # gManager away: only idle loans end; the ledger comes back with it
        changed.wait(interval)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=BUILTIN_MODEL)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--instance-id", required=True)
    parser.add_argument("--gmanager", default="", help="host:port of the gManager (empty: no pool, nothing lent)")
    parser.add_argument("--num-blocks", type=int, required=True)
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    parser.add_argument("--reserve", type=int, default=DEFAULT_RESERVE, help="free blocks never lent to peers")
    parser.add_argument("--loan-idle", type=float, default=60.0, help="seconds after which an unused loan is freed")
    parser.add_argument("--report-interval", type=float, default=DEFAULT_REPORT_INTERVAL_S)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    engine = LLMEngine(load_model(args.model, seed=args.seed),
                       EngineConfig(num_blocks=args.num_blocks, block_size=args.block_size, max_num_seqs=8))
    lock, changed, stop = threading.Lock(), threading.Event(), threading.Event()
    lender = ReportingLender(engine, lock, args.reserve, args.loan_idle, changed=changed)
    address = f"{args.host}:{args.port}"
    gmanager = kvpool_pb2_grpc.GManagerStub(grpc.insecure_channel(args.gmanager)) if args.gmanager else None
    borrower = Borrower(args.instance_id, gmanager, kv_layout(engine), RPC_TIMEOUT_S) if gmanager else None
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16),
                         options=[("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)])
    kvpool_pb2_grpc.add_KVLenderServicer_to_server(lender, server)
    kvpool_pb2_grpc.add_KVNodeServicer_to_server(KVNode(engine, lock, lender, borrower, changed), server)
    server.add_insecure_port(address)
    server.start()
    reporter = None
    if gmanager:
        reporter = threading.Thread(target=report_loop, daemon=True,
                                    args=(lender, gmanager, args.instance_id, address, args.report_interval, changed, stop))
        reporter.start()
    print(f"kvpool node {args.instance_id} listening on {address} ({args.num_blocks} blocks)", flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    changed.set()
    server.stop(grace=1).wait()
    return 0
