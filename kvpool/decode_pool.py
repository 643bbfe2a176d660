"""DecodePool: the KV pool inside a P/D decode (``pdserve decode --kv-pool <gManager>``).

The decode's own block manager is this instance's rManager:
- **lends**: a KVLender gRPC server (``--kv-pool-port``) lends free blocks of the decode's
  engine to peers, at most ``--kv-pool-lend-fraction`` of its pool (the rest is kept free for
  its own requests), and computes micro-attention over them; its ledger row goes to the
  gManager after each loan or release and every ``report_interval_s``, from a thread that
  also frees loans whose borrower left the gManager's live list, and reads the room its
  peers have (``room()``: lendable now, the most ever lendable; the decode's load reports
  carry it so the prefills' pickers and its own admission count the pool).
- **borrows**: ``open`` starts a ``PooledRequest`` for a request whose KV does not fit the free
  blocks here: the local part is reserved in the engine, the overflow is borrowed from
  lenders the gManager suggests, and its decode steps merge the lenders' partial attention.
  Greedy only (the decode's admission refuses the rest). The prompt is computed either by
  the prefill, which pushes each part of its KV over the CacheStore straight to where it
  lives (``expect_kv``: this decode's own leading blocks, then each lender's; a lender's
  receiver is reached through its ``ReceiverInbox``), or, when this decode keeps less than
  one whole block of the prompt, here (ComputePrompt), the overflow's KV put on the lenders.

Who frees what: the decode session calls ``PooledRequest.close`` when the request ends,
whatever happened (loans released, local blocks freed); a lender frees a dead borrower's
loans once the gManager stops listing it; a lender that dies fails only the requests that
borrowed from it (``LenderLost``).
"""

from __future__ import annotations

import asyncio
import math
import threading
from concurrent import futures

import grpc

from pdserve import tls as tls_files
from pdserve.engine.async_engine import AsyncLLMEngine
from pdserve.protos import kvpool_pb2, kvpool_pb2_grpc
from pdserve.test_hooks import NO_GATES, TestGates

from .engine_view import EngineOnThread
from .pooled import PooledRequest
from .reporting import RPC_TIMEOUT_S, Reporter, ReportingLender
from .rmanager import Borrower, kv_layout

DEFAULT_LEND_FRACTION = 0.5
DEFAULT_REPORT_INTERVAL_S = 0.3
DEFAULT_LOAN_IDLE_S = 60.0
GRPC_MESSAGE_BYTES = 256 << 20  # a layer's KV for a long overflow goes in one PutKV


def reserve_for(num_blocks: int, lend_fraction: float) -> int:
    """Free blocks never lent: the pool minus the lendable fraction (rounded down)."""
    if not 0.0 <= lend_fraction <= 1.0:
        raise ValueError(f"--kv-pool-lend-fraction must be within [0, 1], got {lend_fraction}")
    return num_blocks - math.floor(num_blocks * lend_fraction + 1e-9)  # 7/8 of 8 is 7, float error or not


class ReceiverInbox:
    """A lender's CacheStore receiver, called from the KVLender's gRPC threads: every receiver
    call runs on the event loop that owns it."""

    def __init__(self, receiver, loop: asyncio.AbstractEventLoop):
        self.receiver, self.loop = receiver, loop

    def _run(self, coro, timeout_s: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def expect(self, request_id: str, block_ids: list[int], timeout_s: float) -> tuple[bytes, list[int], bytes]:
        """The receiver's endpoint, the destination list and its bind token (the prefill binds with both)."""
        async def expect():
            dst = self.receiver.expect(request_id, block_ids, timeout_s)
            return self.receiver.endpoint, list(dst), dst.token
        return self._run(expect(), RPC_TIMEOUT_S)

    def wait(self, request_id: str, timeout_s: float) -> None:
        """Every layer is in; the entry is unpinned (the blocks belong to the loan alone)."""
        async def wait():
            await self.receiver.wait_all(request_id, timeout_s)
            self.receiver.delete(request_id)
        self._run(wait(), timeout_s + RPC_TIMEOUT_S)

    def drop(self, request_id: str) -> None:
        """Forget the entry (if any); once this returns no frame can land in its blocks."""
        async def drop():
            self.receiver.delete(request_id)
            await self.receiver.released(request_id, 5.0)
        try:
            self._run(drop(), RPC_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the receiver stopped (shutting down): nothing lands any more
            pass


class DecodePool:
    def __init__(self, engine: AsyncLLMEngine, instance_id: str, gmanager: str, host: str, port: int,
                 advertise_host: str | None = None, lend_fraction: float = DEFAULT_LEND_FRACTION,
                 report_interval_s: float = DEFAULT_REPORT_INTERVAL_S, loan_idle_s: float = DEFAULT_LOAN_IDLE_S,
                 inbox: ReceiverInbox | None = None, gates: TestGates = NO_GATES,
                 tls: tls_files.TlsFiles | None = None):
        self.engine = EngineOnThread(engine)
        self.gates = gates  # test hooks (pdserve/test_hooks.py): the pooled requests' gate
        self.instance_id, self.host, self.port = instance_id, host, port
        self.address = f"{advertise_host or host}:{port}"
        self.lock = threading.Lock()  # serializes the lender's bookkeeping; engine calls go to the engine thread
        self.lender = ReportingLender(self.engine, self.lock, reserve_for(engine.num_blocks, lend_fraction),
                                      loan_idle_s)
        self.lender.inbox = inbox
        fast = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 500)]  # back fast after a gManager restart
        self.tls = tls  # mutual TLS on the lender's port and to the gManager and lenders (pdserve/tls.py)
        self._gm_channel = tls_files.channel(gmanager, tls, options=fast)
        self.gmanager = kvpool_pb2_grpc.GManagerStub(self._gm_channel)
        self.borrower = Borrower(instance_id, self.gmanager, kv_layout(self.engine), RPC_TIMEOUT_S, tls)
        self.reporter = Reporter(self.lender, self.gmanager, instance_id, self.address)
        self.report_interval_s = report_interval_s
        self._room = (0, 0)
        self.pooled_requests = self.borrowed_blocks = 0  # totals since start (/health, metrics)
        self._counts = threading.Lock()  # guards those two (never held across an engine call: read at scrapes)
        self._stop = threading.Event()
        self._server: grpc.Server | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Serve KVLender and start reporting (the engine must be started)."""
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=[
            ("grpc.max_receive_message_length", GRPC_MESSAGE_BYTES),
            ("grpc.max_send_message_length", GRPC_MESSAGE_BYTES)])
        kvpool_pb2_grpc.add_KVLenderServicer_to_server(self.lender, self._server)
        if tls_files.add_port(self._server, f"{self.host}:{self.port}", self.tls) == 0:
            raise OSError(f"--kv-pool-port: cannot listen on {self.host}:{self.port}")
        self._server.start()
        self.lender.on_change = self.reporter.send
        self.reporter.after_round = self._read_room
        self._thread = threading.Thread(target=self.reporter.loop, args=(self.report_interval_s, self._stop),
                                        name="pdserve-kvpool-report", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop lending and reporting; every loan held here is freed."""
        self._stop.set()
        if self._server is not None:
            self._server.stop(grace=1).wait()
        if self._thread is not None:
            self._thread.join(timeout=RPC_TIMEOUT_S)
        for request_id in list(self.lender.book.loans):
            self.lender.release(request_id)
        self.borrower.close()
        self._gm_channel.close()

    # ---- borrowing -------------------------------------------------------------------------
    def open(self, request_id: str, prompt: list[int], max_tokens: int, aligned: bool = False) -> PooledRequest:
        """A pooled request with its local blocks reserved and its overflow borrowed (blocking:
        call it off the event loop). OutOfBlocksError (nothing held) when there is no room.
        ``aligned``: the local part of the prompt ends on a block boundary (the prefill pushes it)."""
        pooled = PooledRequest(self.engine, self.lock, self.borrower, RPC_TIMEOUT_S, self.gates)
        try:
            pooled.open(request_id, prompt, max_tokens, aligned=aligned)
        except BaseException:
            pooled.close()
            raise
        finally:
            self.lender.on_change()  # our free blocks changed
        with self._counts:
            self.pooled_requests += 1
            self.borrowed_blocks += sum(loan.blocks for loan in pooled.loans)
        return pooled

    def close(self, pooled: PooledRequest) -> None:
        """Release a pooled request's loans and local blocks (blocking)."""
        try:
            pooled.close()
        finally:
            self.lender.on_change()

    # ---- what the pool offers this decode --------------------------------------------------
    def room(self) -> tuple[int, int]:
        """(blocks the peers could lend now, the most they ever lend), as of the last report round."""
        return self._room

    def _read_room(self) -> None:
        try:
            rows = self.gmanager.GetLedger(kvpool_pb2.LedgerRequest(), timeout=RPC_TIMEOUT_S).rows
        except grpc.RpcError:
            self._room = (0, 0)  # no gManager: nobody to borrow from
            return
        peers = [r for r in rows if r.lender != self.instance_id]
        self._room = (sum(r.lendable_blocks for r in peers), sum(r.max_lendable_blocks for r in peers))

    def stats(self) -> dict:
        """For /health: loans held here for peers (``loans``, ``lent_blocks``: back to 0 when idle),
        the pool's room for us, and the requests we served pooled and the blocks they borrowed (totals)."""
        loans = list(self.lender.book.loans.values())  # a snapshot: self.lock may be held across an engine call
        with self._counts:
            pooled, borrowed = self.pooled_requests, self.borrowed_blocks
        free, total = self._room
        return {"instance_id": self.instance_id, "loans": len(loans),
                "lent_blocks": sum(len(l.block_ids) for l in loans), "pool_free_blocks": free,
                "pool_total_blocks": total, "pooled_requests_total": pooled, "borrowed_blocks_total": borrowed}
