"""The rManager's link to the gManager: ``ReportingLender`` (a BlockLender that reports its row
right after each loan or release) and ``Reporter`` (sends the row, one report at a time, and
every interval from a thread that also frees loans of borrowers the gManager no longer lists).
Used by ``pdserve kvpool node`` (node.py) and by a P/D decode's pool (decode_pool.py).
"""

from __future__ import annotations

import threading
import traceback
from typing import Callable

import grpc

from pdserve.protos import kvpool_pb2_grpc

from .rmanager import BlockLender

RPC_TIMEOUT_S = 10.0


class ReportingLender(BlockLender):
    """A BlockLender that reports its row right after each loan or release, so the gManager's
    view is current when the borrower's Lend or Release call returns."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_change = lambda: None

    def Lend(self, request, context):
        try:
            return super().Lend(request, context)
        finally:
            self.on_change()

    def release(self, request_id: str) -> int:
        freed = super().release(request_id)
        if freed:
            self.on_change()
        return freed


class Reporter:
    """Sends the rManager's ledger row to the gManager (one report at a time, never reordered)."""

    def __init__(self, lender: BlockLender, gmanager: kvpool_pb2_grpc.GManagerStub, instance: str, address: str):
        self.lender, self.gmanager, self.instance, self.address = lender, gmanager, instance, address
        self.lock = threading.Lock()
        self.after_round: Callable[[], None] = lambda: None  # called by ``loop`` after each report

    def send(self) -> set[str] | None:
        """The live instances the gManager lists; None when it did not answer or has not heard
        from everyone yet (just restarted)."""
        with self.lock:
            try:
                reply = self.gmanager.Report(self.lender.report(self.instance, self.address), timeout=RPC_TIMEOUT_S)
            except grpc.RpcError:
                return None
        return set(reply.live_instances) if reply.complete else None

    def loop(self, interval: float, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                # gManager away or just restarted (None): only idle loans end
                self.lender.sweep(self.send())
                self.after_round()
            except Exception:  # keep reporting: a dead report thread would make this decode look dead
                traceback.print_exc()
            stop.wait(interval)
