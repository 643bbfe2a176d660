"""Run the KV pool's gManager: who has room, and the global debt ledger (gRPC GManager).

Each rManager reports every ``--report-interval`` (and after each loan or release): its free and
lendable blocks and what it lent to whom. The gManager keeps the latest report per instance
(``ledger.py``), drops instances silent for ``--ttl`` seconds, and answers FindLenders with
up to three live instances that have room. It holds no state a report cannot rebuild, so
restarting it loses nothing but the time to the next round of reports.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from concurrent import futures

import grpc

from pdserve import tls
from pdserve.protos import KVPOOL_VERSION, kvpool_pb2, kvpool_pb2_grpc

from .ledger import DebtLedger

DEFAULT_TTL_S = 2.0


class GManager(kvpool_pb2_grpc.GManagerServicer):
    def __init__(self, ttl_s: float = DEFAULT_TTL_S):
        self.ledger = DebtLedger(ttl_s)
        self.lock = threading.Lock()
        self.started = time.monotonic()  # until one ttl has passed, not every instance has reported yet

    def Report(self, request, context):
        if request.version != KVPOOL_VERSION:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"kvpool version {request.version} reported, this gManager speaks {KVPOOL_VERSION}")
        now = time.monotonic()
        try:
            with self.lock:
                self.ledger.report(request.instance_id, request.address, request.free_blocks,
                                   request.lendable_blocks, {d.borrower: d.blocks for d in request.lent}, now,
                                   request.max_lendable_blocks)
                self.ledger.expire(now)
                live = self.ledger.live()
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return kvpool_pb2.ReportReply(live_instances=live, complete=now - self.started > self.ledger.ttl_s)

    def FindLenders(self, request, context):
        try:
            with self.lock:
                self.ledger.expire(time.monotonic())
                found = self.ledger.candidates(request.borrower, request.blocks, set(request.exclude))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return kvpool_pb2.FindLendersReply(candidates=[
            kvpool_pb2.Candidate(instance_id=i, address=a, lendable_blocks=n) for i, a, n in found])

    def GetLedger(self, request, context):
        with self.lock:
            self.ledger.expire(time.monotonic())
            rows = [kvpool_pb2.LedgerRow(lender=i, address=r.address, free_blocks=r.free_blocks,
                                         lendable_blocks=r.lendable_blocks, max_lendable_blocks=r.max_lendable,
                                         lent=[kvpool_pb2.Debt(borrower=b, blocks=n)
                                               for b, n in sorted(r.lent.items())])
                    for i, r in sorted(self.ledger.rows.items())]
        return kvpool_pb2.LedgerReply(rows=rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ttl", type=float, default=DEFAULT_TTL_S,
                        help="seconds without a report after which an instance (and its ledger row) is dropped")
    tls.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    files = tls.from_args(args, "pdserve kvpool gmanager")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    kvpool_pb2_grpc.add_GManagerServicer_to_server(GManager(args.ttl), server)
    tls.add_port(server, f"{args.host}:{args.port}", files)
    server.start()
    print(f"gmanager listening on {args.host}:{args.port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.2):
        pass
    server.stop(grace=1).wait()
    return 0
