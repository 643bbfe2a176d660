"""rManager: one decode's side of the pool. ``BlockLender`` lends blocks of the decode's own
engine pool (the KVLender service); ``Borrower`` finds lenders through the gManager and holds
a pooled request's loans.

Lender lifecycle of one loan: Lend (blocks reserved in the engine under ``loan:<request>``,
at most ``free - reserve``; a peer with another KV layout or protocol version is refused) ->
PutKV per layer (the borrower writes the prompt's overflow KV) -> Attend per layer and decode
step (micro-attention over the loan's tokens; only the query comes in, a Partial goes out) ->
Release (the borrower's request finished or failed: blocks back to the engine). In P/D, a
lender with an ``inbox`` (its decode's CacheStore receiver, kvpool/decode_pool.py) may take
the loan's KV from the prefill instead of PutKV: ExpectKV (the entry expected) -> the prefill
pushes -> KVArrived (every layer in, the entry unpinned, the loan's tokens set). Loans whose
borrower left the gManager's live set, or idle for ``idle_s``, are freed by ``sweep``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import grpc
import torch

from pdserve import tls as tls_files
from pdserve.engine.errors import OutOfBlocksError
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protos import KVPOOL_VERSION, kvpool_pb2, kvpool_pb2_grpc

from .attention import micro_attention, to_bytes
from .errors import LenderLost
from .loans import Loan, LoanBook

LOAN_PREFIX = "loan:"
BORROW_ROUNDS = 3


def kv_layout(engine: LLMEngine) -> str:
    """What two peers must agree on to share KV: layers/kv_heads/head_dim/block_size/dtype, then "/fp8" for
    an fp8 cache (its blocks hold fp8 rows and scales: a peer with 16/32-bit rows cannot read them)."""
    kv = engine.kv_cache
    dtype = str(kv.compute_dtype).removeprefix("torch.")
    return f"{kv.num_layers}/{kv.num_kv_heads}/{kv.head_dim}/{kv.block_size}/{dtype}" + ("/fp8" if kv.fp8 else "")


def tensor(raw: bytes, *shape: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.float32).view(*shape)


class BlockLender(kvpool_pb2_grpc.KVLenderServicer):
    """Lends blocks of ``engine``'s pool. ``lock`` guards every engine call (shared with the node)."""

    def __init__(self, engine: LLMEngine, lock: threading.Lock, reserve: int, idle_s: float, gone_s: float = 1.0):
        self.engine, self.lock = engine, lock
        self.book = LoanBook(reserve, idle_s, gone_s)
        self.kv = engine.kv_cache
        self.layout = kv_layout(engine)
        self._rows: dict[str, torch.Tensor] = {}  # request id -> K rows of its loan's slots
        self.inbox = None  # P/D: the decode's CacheStore receiver (ExpectKV / KVArrived); None: PutKV only
        self._expected: dict[str, tuple[str, int]] = {}  # request id -> (its CacheStore entry, tokens it brings)

    # ---- KVLender --------------------------------------------------------------------------
    def Lend(self, request, context):
        if request.version != KVPOOL_VERSION or request.layout != self.layout:
            return kvpool_pb2.LendReply(refusal=f"incompatible peer: version {request.version} "
                                                 f"layout {request.layout!r}, this lender has version "
                                                 f"{KVPOOL_VERSION} layout {self.layout!r}")
        if request.blocks <= 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"blocks must be positive, got {request.blocks}")
        bs = self.kv.block_size
        with self.lock:
            n = self.book.grant(request.blocks, self.engine.num_free_blocks())
            if n == 0:
                return kvpool_pb2.LendReply(refusal=f"no lendable blocks (reserve {self.book.reserve})")
            try:
                ids = self.engine.pd.reserve(LOAN_PREFIX + request.request_id, n * bs - 1, 1)
            except (OutOfBlocksError, ValueError) as e:
                return kvpool_pb2.LendReply(refusal=str(e))
            self.book.add(Loan(request.request_id, request.borrower, ids, 0, time.monotonic()))
            self._rows[request.request_id] = self.kv.table_rows(torch.tensor(ids)).reshape(-1)
        why = "" if n == request.blocks else f"lent {n} of {request.blocks} (reserve {self.book.reserve})"
        return kvpool_pb2.LendReply(granted_blocks=n, refusal=why)

    def PutKV(self, request, context):
        loan, rows = self._loan(request.request_id, context)
        self._check_layer(request.layer, context)
        if request.start < 0 or request.start + request.num_tokens > rows.numel():
            context.abort(grpc.StatusCode.OUT_OF_RANGE,
                          f"tokens [{request.start}, {request.start + request.num_tokens}) "
                                                        f"do not fit the loan's {rows.numel()} slots")
        shape = (request.num_tokens, self.kv.num_kv_heads, self.kv.head_dim)
        want = 4 * request.num_tokens * self.kv.num_kv_heads * self.kv.head_dim
        if len(request.k) != want or len(request.v) != want:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"K/V of {request.num_tokens} tokens must be {want} bytes "
                                                            f"of float32 each, got "
                                                            f"{len(request.k)} and {len(request.v)}")
        self.kv.write(request.layer, rows[request.start : request.start + request.num_tokens],
                      tensor(request.k, *shape), tensor(request.v, *shape))
        loan.tokens = max(loan.tokens, request.start + request.num_tokens)
        loan.used_at = time.monotonic()
        return kvpool_pb2.PutKVReply()

    def Attend(self, request, context):
        loan, rows = self._loan(request.request_id, context)
        self._check_layer(request.layer, context)
        if len(request.q) != 4 * request.num_heads * self.kv.head_dim or request.num_heads % self.kv.num_kv_heads:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"the query must be float32 [num_heads, {self.kv.head_dim}] "
                                                            f"with num_heads a multiple of {self.kv.num_kv_heads}")
        if loan.tokens == 0:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"request {request.request_id!r} put no KV here yet")
        k, v = self.kv.gather(request.layer, rows[: loan.tokens])
        part = micro_attention(tensor(request.q, request.num_heads, self.kv.head_dim), k, v)
        loan.used_at = time.monotonic()
        m, s, w = to_bytes(part)
        return kvpool_pb2.AttendReply(max=m, sum_exp=s, weighted=w)

    def ExpectKV(self, request, context):
        loan, rows = self._loan(request.request_id, context)
        if self.inbox is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this lender takes KV by PutKV only (no CacheStore)")
        if not 0 < request.num_tokens <= rows.numel() or request.timeout_s <= 0 or not request.entry_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"num_tokens must be within 1..{rows.numel()}, timeout_s "
                                                            f"positive and entry_id set, got {request.num_tokens}, "
                                                            f"{request.timeout_s}, {request.entry_id!r}")
        if request.request_id in self._expected:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"KV for {request.request_id!r} is already expected here")
        ids = loan.block_ids[: -(-request.num_tokens // self.kv.block_size)]
        try:
            endpoint, for_sender, token = self.inbox.expect(request.entry_id, ids, request.timeout_s)
        except Exception as e:  # noqa: BLE001 - already expected, receiver stopped: the borrower must know
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot expect KV for {request.request_id!r}: {e}")
        self._expected[request.request_id] = (request.entry_id, request.num_tokens)
        loan.used_at = time.monotonic()
        return kvpool_pb2.ExpectKVReply(cachestore_endpoint=endpoint, block_ids=for_sender, kv_token=token)

    def KVArrived(self, request, context):
        loan, _ = self._loan(request.request_id, context)
        expected = self._expected.get(request.request_id)
        if expected is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no KV expected for {request.request_id!r} here")
        entry_id, tokens = expected
        try:
            self.inbox.wait(entry_id, request.timeout_s)
        except Exception as e:  # noqa: BLE001 - timeout, checksum, deleted: the request cannot go on
            context.abort(grpc.StatusCode.DATA_LOSS, f"the KV of {request.request_id!r} did not arrive here: {e}")
        self._expected.pop(request.request_id, None)
        loan.tokens, loan.used_at = tokens, time.monotonic()
        return kvpool_pb2.KVArrivedReply()

    def Release(self, request, context):
        return kvpool_pb2.ReleaseReply(freed_blocks=self.release(request.request_id))

    # ---- bookkeeping -----------------------------------------------------------------------
    def _check_layer(self, layer: int, context) -> None:
        if not 0 <= layer < self.kv.num_layers:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"layer {layer} out of range (0..{self.kv.num_layers - 1})")

    def _loan(self, request_id: str, context) -> tuple[Loan, torch.Tensor]:
        loan = self.book.loans.get(request_id)
        rows = self._rows.get(request_id)
        if loan is None or rows is None:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"no loan for request {request_id!r} here (released, expired, or never lent)")
        return loan, rows

    def release(self, request_id: str) -> int:
        expected = self._expected.pop(request_id, None)
        if self.inbox is not None and expected is not None:
            self.inbox.drop(expected[0])  # no frame can land in the loan's blocks after this
        with self.lock:
            loan = self.book.pop(request_id)
            self._rows.pop(request_id, None)
            if loan is None:
                return 0
            self.engine.abort(LOAN_PREFIX + request_id)
            return len(loan.block_ids)

    def sweep(self, live: set[str] | None) -> list[str]:
        """Free loans of borrowers gone from ``live`` (None: unknown) or idle too long."""
        with self.lock:  # Lend and release change the book from gRPC threads
            stale = self.book.stale(live, time.monotonic())
        for request_id in stale:
            self.release(request_id)
        return stale

    def report(self, instance: str, address: str) -> kvpool_pb2.InstanceReport:
        with self.lock:
            free = self.engine.num_free_blocks()
            lent = self.book.lent()
        return kvpool_pb2.InstanceReport(
            instance_id=instance, address=address, free_blocks=free, lendable_blocks=self.book.lendable(free),
            lent=[kvpool_pb2.Debt(borrower=b, blocks=n) for b, n in sorted(lent.items())], version=KVPOOL_VERSION,
            max_lendable_blocks=self.book.lendable(self.engine.num_blocks))


@dataclass(slots=True)
class RemoteLoan:
    """Blocks one lender holds for a pooled request: tokens [start, start + tokens) of its overflow."""

    lender: str
    address: str
    stub: kvpool_pb2_grpc.KVLenderStub
    blocks: int
    start: int = 0
    tokens: int = 0


class Borrower:
    """Finds room on peers for a request's overflow (the gManager suggests, lenders decide)."""

    def __init__(self, instance: str, gmanager: kvpool_pb2_grpc.GManagerStub, layout: str, rpc_timeout_s: float,
                 tls: tls_files.TlsFiles | None = None):
        self.instance, self.gmanager, self.layout, self.timeout = instance, gmanager, layout, rpc_timeout_s
        self.tls = tls  # mutual TLS to the lenders (pdserve/tls.py); None: plain
        self._channels: dict[str, grpc.Channel] = {}

    def loan_id(self, request_id: str) -> str:
        """The id a request's loans carry on the wire: request ids are only unique per decode."""
        return f"{self.instance}/{request_id}"

    def stub(self, address: str) -> kvpool_pb2_grpc.KVLenderStub:
        if address not in self._channels:
            self._channels[address] = tls_files.channel(address, self.tls)
        return kvpool_pb2_grpc.KVLenderStub(self._channels[address])

    def borrow(self, request_id: str, blocks: int) -> list[RemoteLoan]:
        """Loans summing to ``blocks``; OutOfBlocksError (every loan given back) if the pool has less, or
        LenderLost naming the lenders that did not answer when the others could not make up for them (a
        lender that dies while lending: the request fails as it does in its later phases)."""
        loans: list[RemoteLoan] = []
        silent: set[str] = set()
        need = blocks
        try:
            for attempt in range(BORROW_ROUNDS):  # later rounds: the gManager's view may have caught up
                if attempt:
                    time.sleep(0.1 * attempt)
                try:
                    reply = self.gmanager.FindLenders(kvpool_pb2.FindLendersRequest(
                        borrower=self.instance, blocks=need,
                        exclude=sorted(l.lender for l in loans)), timeout=self.timeout)
                except grpc.RpcError as e:
                    raise OutOfBlocksError(f"request {request_id!r} needs {blocks} KV blocks from the pool but the "
                                           f"gManager did not answer ({e.code().name})") from None
                for c in reply.candidates:
                    stub = self.stub(c.address)
                    try:
                        got = stub.Lend(kvpool_pb2.LendRequest(
                            borrower=self.instance, request_id=self.loan_id(request_id), blocks=need,
                            layout=self.layout, version=KVPOOL_VERSION), timeout=self.timeout)
                    except grpc.RpcError:
                        silent.add(c.instance_id)  # gone since its last report: the gManager drops it after its ttl
                        continue
                    if got.granted_blocks:
                        loans.append(RemoteLoan(c.instance_id, c.address, stub, got.granted_blocks))
                        need -= got.granted_blocks
                    if need == 0:
                        return loans
            got_total = blocks - need
            if silent:
                raise LenderLost(f"request {request_id!r} failed: KV lender {', '.join(sorted(silent))} did not "
                                 f"answer while lending, and the others had only {got_total} of the {blocks} "
                                 "blocks it needs")
            raise OutOfBlocksError(f"request {request_id!r} needs {blocks} KV blocks from the pool but its lenders "
                                   f"had only {got_total} to lend")
        except BaseException:
            self.release(request_id, loans)
            raise

    def release(self, request_id: str, loans: list[RemoteLoan]) -> None:
        """Give every loan back (best effort: a dead lender's blocks died with it)."""
        for loan in loans:
            try:
                loan.stub.Release(kvpool_pb2.ReleaseRequest(request_id=self.loan_id(request_id)), timeout=self.timeout)
            except grpc.RpcError:
                pass

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
