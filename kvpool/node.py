"""Run one decode of a KV pool: an engine with a small pool, its rManager, and KVNode.Generate.

The engine's blocks serve this decode's own requests (``pooled=false``: the engine's normal
path; ``pooled=true``: ``PooledRequest``, spilling onto lenders) and are lent to peers
(KVLender) down to ``--reserve`` free blocks. The rManager's row goes to the gManager right
after each loan, release or request here, and every ``--report-interval`` seconds from a thread
that also frees loans whose borrower the gManager no longer lists.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from concurrent import futures

import grpc
import torch

from pdserve import tls
from pdserve.defaults import BLOCK_SIZE, BUILTIN_MODEL
from pdserve.engine.errors import OutOfBlocksError
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.loader import load_model
from pdserve.engine.sampling import SamplingParams
from pdserve.protos import kvpool_pb2, kvpool_pb2_grpc
from pdserve.test_hooks import NO_GATES, TestGates

from .pooled import PooledRequest
from .reporting import RPC_TIMEOUT_S, Reporter, ReportingLender
from .rmanager import Borrower, LenderLost, kv_layout

DEFAULT_RESERVE = 1
DEFAULT_REPORT_INTERVAL_S = 0.3
NORMAL_PATH_STALL_S = 5.0  # a normal-path request that gets no token this long fails (its blocks are lent)


class KVNode(kvpool_pb2_grpc.KVNodeServicer):
    def __init__(self, engine: LLMEngine, lock: threading.Lock, lender: ReportingLender, borrower: Borrower | None,
                 gates: TestGates = NO_GATES):
        self.engine, self.lock, self.lender, self.borrower = engine, lock, lender, borrower
        self.gates = gates  # test hooks (pdserve/test_hooks.py), read once where the node starts
        self.normal_path = threading.Lock()  # one normal-path request at a time (each takes its own outputs)
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
            self.lender.on_change()  # its own free blocks changed

    def _pooled(self, request, ids, n):
        with self.lock:
            self.pooled_running += 1
        try:
            res = PooledRequest(self.engine, self.lock, self.borrower, RPC_TIMEOUT_S, self.gates).run(
                request.request_id, ids, n, request.ignore_eos, request.max_local_blocks)
        finally:
            with self.lock:
                self.pooled_running -= 1
        logits = torch.stack(res.logits).numpy().tobytes() if request.return_logits and res.logits else b""
        return kvpool_pb2.GenerateReply(
            token_ids=res.token_ids, logits=logits, local_blocks=res.local_blocks,
            borrowed_blocks=sum(l.blocks for l in res.loans), lenders=[l.lender for l in res.loans],
            prefill_s=res.prefill_s, decode_s=res.decode_s)

    def _normal(self, request_id, ids, n, ignore_eos):
        """The engine's own path (colocated add_request/step), greedy: the reference."""
        sampling = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=ignore_eos)
        with self.normal_path:
            return self._normal_locked(request_id, ids, sampling)

    def _normal_locked(self, request_id, ids, sampling):
        tokens, t0 = [], time.perf_counter()
        first = None
        with self.lock:
            self.engine.add_request(request_id, ids, sampling)
        try:
            progress = time.monotonic()
            while True:
                with self.lock:  # one step at a time: loans and reports go on between steps
                    outs = [o for o in self.engine.step() if o.request_id == request_id]
                    if outs:
                        progress = time.monotonic()
                    elif time.monotonic() - progress > NORMAL_PATH_STALL_S:
                        raise OutOfBlocksError(
                            f"request {request_id!r} waited {NORMAL_PATH_STALL_S:g} s for KV blocks: "
                            f"{self.engine.num_free_blocks()} free, {self.lender.book.lent_blocks()} lent to peers")
                if not outs:
                    time.sleep(0.01)
                for out in outs:
                    tokens += out.new_token_ids
                if tokens and first is None:
                    first = time.perf_counter()
                if any(o.finished for o in outs):
                    break
        finally:
            with self.lock:
                self.engine.abort(request_id)
        end = time.perf_counter()
        first = first or end
        return kvpool_pb2.GenerateReply(token_ids=tokens, local_blocks=0, prefill_s=first - t0, decode_s=end - first)

    def Stats(self, request, context):
        with self.lock:
            return kvpool_pb2.StatsReply(
                num_blocks=self.engine.num_blocks, free_blocks=self.engine.num_free_blocks(),
                loans=len(self.lender.book.loans), lent_blocks=self.lender.book.lent_blocks(),
                engine_requests=self.engine.num_requests(), pooled_requests=self.pooled_running)


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
    tls.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    files = tls.from_args(args, "pdserve kvpool node")
    torch.set_num_threads(args.threads)
    engine = LLMEngine(load_model(args.model, seed=args.seed),
                       EngineConfig(num_blocks=args.num_blocks, block_size=args.block_size, max_num_seqs=8))
    lock, stop = threading.Lock(), threading.Event()
    lender = ReportingLender(engine, lock, args.reserve, args.loan_idle)
    address = f"{args.host}:{args.port}"
    # reconnect fast after a gManager restart (the default backoff grows past its ttl)
    fast = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 500)]
    gmanager = (kvpool_pb2_grpc.GManagerStub(tls.channel(args.gmanager, files, options=fast))
                if args.gmanager else None)
    borrower = Borrower(args.instance_id, gmanager, kv_layout(engine), RPC_TIMEOUT_S, files) if gmanager else None
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16),
                         options=[("grpc.max_receive_message_length", 256 << 20),
                                  ("grpc.max_send_message_length", 256 << 20)])
    kvpool_pb2_grpc.add_KVLenderServicer_to_server(lender, server)
    node = KVNode(engine, lock, lender, borrower, TestGates.from_environment())
    kvpool_pb2_grpc.add_KVNodeServicer_to_server(node, server)
    tls.add_port(server, address, files)
    server.start()
    if gmanager:
        reporter = Reporter(lender, gmanager, args.instance_id, address)
        lender.on_change = reporter.send
        threading.Thread(target=reporter.loop, args=(args.report_interval, stop), daemon=True).start()
    print(f"kvpool node {args.instance_id} listening on {address} ({args.num_blocks} blocks)", flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.2):
        pass
    server.stop(grace=1).wait()
    return 0
