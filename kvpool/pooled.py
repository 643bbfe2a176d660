"""PooledRequest: one request whose KV spills from this decode's pool onto lenders (DistAttention).

Lifecycle:
1. Plan: this decode keeps as many of the request's tokens as its free blocks hold (always
   every generated token, so decode steps only append locally); the rest of the prompt (the
   overflow) is borrowed: the ``Borrower`` gets loans from lenders the gManager suggests.
2. Prefill, here: layer by layer over the whole prompt (the engine's prefill math), writing
   the local tokens' KV into the local blocks and sending each overflow span's KV to its
   lender (PutKV; one layer's sends overlap the next layer's compute). The decode moves the
   overflow to the lenders itself; the prefill server's CacheStore is not used for it.
3. Decode steps: per layer, the new token's K/V go into a local slot, the query goes to every
   lender (Attend, in parallel), the local micro-attention runs meanwhile, and the partial
   results are merged (``attention.merge``). Greedy sampling.
4. End (finished, failed, or a lender lost): every loan is released and the local blocks are
   freed; a lender that does not answer fails the request with ``LenderLost`` naming it.

The steps are ``open`` (1: plan, local reservation, loans), ``tokens`` (2-3: a generator of
token ids; the P/D decode streams them as they come) and ``close`` (4: always); ``run`` is
the three in one call (``pdserve kvpool node``'s Generate).

In P/D the prefill may compute the prompt instead of step 2 (``open(aligned=True)``: the local
part ends on a block boundary when at least one whole block of the prompt stays here): ``expect_kv`` has each lender's CacheStore receiver expect its
part (the prefill pushes it there, and the local part to this decode's receiver), ``kv_arrived``
waits until every lender has it, then ``tokens(first_token=...)`` runs only the decode steps.
"""  # noqa: E501

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Generator, Iterator

import grpc
import torch
import torch.nn.functional as F

from pdserve.engine import kv_quant
from pdserve.engine.block_manager import blocks_needed
from pdserve.engine.errors import OutOfBlocksError
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protos import kvpool_pb2
from pdserve.test_hooks import NO_GATES, TestGates, hold_at_gate

from .attention import from_bytes, merge, micro_attention
from .rmanager import Borrower, LenderLost, RemoteLoan

POOLED_PREFIX = "pooled:"
# test hook (pdserve/test_hooks.py, TestGates.kvpool): ``run`` holds a request with its loans taken,
# before its first token, until the test opens the gate


@dataclass
class PooledResult:
    token_ids: list[int]
    logits: list[torch.Tensor]  # [vocab] float32 per generated token
    local_blocks: int
    loans: list[RemoteLoan]
    prefill_s: float
    decode_s: float
    extra: dict = field(default_factory=dict)


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.float().contiguous().numpy().tobytes()


class PooledRequest:
    """One pooled request: ``open`` -> ``tokens`` -> ``close`` (always), or ``run``."""

    def __init__(self, engine: LLMEngine, lock: threading.Lock, borrower: Borrower | None, rpc_timeout_s: float,
                 gates: TestGates = NO_GATES):
        self.engine, self.lock, self.borrower, self.timeout = engine, lock, borrower, rpc_timeout_s
        self.gates = gates  # test hooks (pdserve/test_hooks.py), read once where the pool is built
        self.model, self.kv = engine.model, engine.kv_cache
        self.cfg = engine.model_config
        self.request_id = ""
        self.local_id: str | None = None  # the local reservation, until close
        self.loans: list[RemoteLoan] = []
        self.prompt: list[int] = []
        self.max_tokens = self.keep = self.local_blocks = 0
        self.rows: torch.Tensor | None = None
        self.table: list[int] = []  # the local reservation's blocks (the prompt's leading keep tokens first)
        self.logits: list[torch.Tensor] = []  # [vocab] float32 per generated token (greedy's argmax input)
        self.prefill_s = self.decode_s = 0.0

    def run(self, request_id: str, prompt: list[int], max_tokens: int, ignore_eos: bool = False,
            max_local_blocks: int = 0) -> PooledResult:
        """Generate greedily; ``max_local_blocks`` > 0 caps the blocks kept here (to measure spilling)."""
        try:
            self.open(request_id, prompt, max_tokens, max_local_blocks)
            gate = self.gates.kvpool  # test hook above
            if gate:
                hold_at_gate(gate, request_id)
            tokens = list(self.tokens(ignore_eos))
            return PooledResult(tokens, self.logits, self.local_blocks, self.loans, self.prefill_s, self.decode_s)
        finally:
            self.close()

    def open(self, request_id: str, prompt: list[int], max_tokens: int, max_local_blocks: int = 0,
             aligned: bool = False) -> None:
        """Step 1: reserve the local blocks and borrow the overflow's. OutOfBlocksError (nothing
        held) when the local pool cannot hold the generated tokens or the lenders lack room;
        LenderLost when a lender fails while lending. ``close`` frees what this took."""
        n_prompt, bs = len(prompt), self.engine.block_size
        if n_prompt < 1 or max_tokens < 1:
            raise ValueError(f"need a prompt and max_tokens >= 1, got {n_prompt} tokens, max_tokens {max_tokens}")
        if n_prompt + max_tokens > self.engine.max_model_len:
            raise ValueError(f"request {request_id!r}: {n_prompt} prompt tokens + max_tokens {max_tokens} exceed the "
                             f"maximum context length {self.engine.max_model_len}")
        self.request_id, self.prompt, self.max_tokens = request_id, list(prompt), max_tokens
        local_id = POOLED_PREFIX + request_id
        with self.lock:
            free = self.engine.num_free_blocks()
            if max_local_blocks > 0:
                free = min(free, max_local_blocks)
            keep = min(n_prompt, free * bs - max_tokens)
            if aligned and bs <= keep < n_prompt:  # whole blocks here (the CacheStore moves blocks), if one fits
                keep -= keep % bs
            if keep < 0:
                raise OutOfBlocksError(f"request {request_id!r}: its {max_tokens} generated tokens need "
                                       f"{blocks_needed(max_tokens, bs)} local blocks, {free} are free")
            table = self.engine.pd.reserve(local_id, max(keep + max_tokens - 1, 1), 1)  # keep + max_tokens slots
        self.local_id, self.keep, self.local_blocks, self.table = local_id, keep, len(table), list(table)
        self.rows = self.kv.table_rows(torch.tensor(table)).reshape(-1)
        overflow = n_prompt - keep
        if overflow:
            if self.borrower is None:
                raise OutOfBlocksError(f"request {request_id!r} needs {blocks_needed(overflow, bs)} more blocks "
                                       "and this decode has no KV pool")
            try:
                self.loans = self.borrower.borrow(request_id, blocks_needed(overflow, bs))
            except grpc.RpcError as e:
                raise LenderLost(self._lost(e)) from None
            start = keep
            for loan in self.loans:
                loan.start, loan.tokens = start, min(loan.blocks * bs, n_prompt - start)
                start += loan.tokens

    def tokens(self, ignore_eos: bool = False, stop_ids: frozenset[int] | set[int] = frozenset(),
               first_token: int | None = None) -> Generator[int, None, None]:
        """Steps 2-3: the greedy token ids, each as soon as it is known; an EOS (unless
        ``ignore_eos``) or a stop id ends the stream and is not yielded. ``first_token``: the
        prompt's KV is in place already (the prefill pushed it) and its first token was
        reported: only the tokens after it. LenderLost when a lender does not answer."""
        ends = set(stop_ids) | (set() if ignore_eos else self.engine.eos_ids)
        try:
            if first_token is None:
                yield from self._decode(self._prefill(), True, ends)
            else:
                yield from self._decode(first_token, False, ends)
        except grpc.RpcError as e:
            raise LenderLost(self._lost(e)) from None

    def expect_kv(self, timeout_s: float) -> list[tuple[RemoteLoan, str, kvpool_pb2.ExpectKVReply]]:
        """P/D: each lender's CacheStore receiver expects its part of the prompt: (loan, entry id,
        the endpoint and block ids the prefill binds that id to), the loans in prompt order."""
        wire_id = self.borrower.loan_id(self.request_id)
        out = []
        try:
            for i, loan in enumerate(loan for loan in self.loans if loan.tokens):
                entry_id = f"{wire_id}#part{i}"
                out.append((loan, entry_id, self._wait(self._call(loan, "ExpectKV", kvpool_pb2.ExpectKVRequest(
                    request_id=wire_id, num_tokens=loan.tokens, timeout_s=timeout_s, entry_id=entry_id)))))
            return out
        except grpc.RpcError as e:
            raise LenderLost(self._lost(e)) from None

    def kv_arrived(self, timeout_s: float) -> None:
        """P/D: wait until every lender has all of its part (in parallel)."""
        futures = [self._call(loan, "KVArrived", kvpool_pb2.KVArrivedRequest(
            request_id=self.borrower.loan_id(self.request_id), timeout_s=timeout_s), timeout_s + self.timeout)
            for loan in self.loans if loan.tokens]
        try:
            for future in futures:
                self._wait(future)
        except grpc.RpcError as e:
            raise LenderLost(self._lost(e)) from None

    def close(self) -> None:
        """Step 4: give every loan back and free the local blocks (idempotent)."""
        loans, self.loans = self.loans, []
        if self.borrower is not None and loans:
            self.borrower.release(self.request_id, loans)
        if self.local_id is not None:
            local_id, self.local_id = self.local_id, None
            with self.lock:
                self.engine.abort(local_id)

    def _lost(self, error: grpc.RpcError) -> str:
        detail = error.details() if hasattr(error, "details") else str(error)
        who = (getattr(error, "lender", None)
               or "of " + (", ".join(f"{l.lender} ({l.address})" for l in self.loans) or "none"))
        return f"request {self.request_id!r} failed: KV lender {who} did not answer ({detail}); its KV there is lost"

    def _call(self, loan: RemoteLoan, method: str, message, timeout: float | None = None):
        future = getattr(loan.stub, method).future(message, timeout=timeout or self.timeout)
        future.loan = loan
        return future

    def _wait(self, future):
        try:
            return future.result()
        except grpc.RpcError as e:
            e.lender = f"{future.loan.lender} ({future.loan.address}, holding {future.loan.blocks} of its blocks)"
            raise

    @torch.inference_mode()
    def _prefill(self) -> int:
        """The prompt layer by layer: local KV written here, the overflow's put on the lenders."""
        model, kv, prompt, keep, rows = self.model, self.kv, self.prompt, self.keep, self.rows
        loans = [loan for loan in self.loans if loan.tokens]  # all of them: the need was exact
        wire_id = self.borrower.loan_id(self.request_id) if loans else self.request_id
        t0 = time.perf_counter()
        ids = torch.tensor(prompt, device=self.engine.device)
        x = model.embed_tokens(ids)
        cos, sin = model.rope(torch.arange(len(prompt)), x.dtype)
        pending = []
        for i, layer in enumerate(model.layers):
            q, k, v = layer.qkv(x, cos, sin)
            if kv.fp8:
                # attend over what the caches will hold, as the engine's prefill does (KVCache.write returns it);
                # quantizing these values again (here and on the lenders) gives the same bytes
                k, v = (kv_quant.dequantize(kv_quant.quantize(t), t.dtype) for t in (k, v))
            if keep:
                kv.write(i, rows[:keep], k[:keep], v[:keep])
            for fut in pending:
                self._wait(fut)
            pending = [self._call(loan, "PutKV", kvpool_pb2.PutKVRequest(
                request_id=wire_id, layer=i, start=0, num_tokens=loan.tokens,
                k=_as_bytes(k[loan.start : loan.start + loan.tokens]),
                v=_as_bytes(v[loan.start : loan.start + loan.tokens])))
                for loan in loans]
            o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                               v.transpose(0, 1).unsqueeze(0), is_causal=True, enable_gqa=True)
            x = layer.finish(x, o.squeeze(0).transpose(0, 1).reshape(x.shape[0], -1))
        for fut in pending:
            self._wait(fut)
        self.logits = [model.lm_head(model.norm(x[-1:])).float()[0]]
        self.prefill_s = time.perf_counter() - t0
        return int(self.logits[-1].argmax())

    @torch.inference_mode()
    def _decode(self, token: int, yield_first: bool, ends: set[int]) -> Iterator[int]:
        """Decode steps from the first token (yielded only when ``yield_first``)."""
        model, cfg, kv, prompt, rows = self.model, self.cfg, self.kv, self.prompt, self.rows
        loans = [loan for loan in self.loans if loan.tokens]
        wire_id = self.borrower.loan_id(self.request_id) if loans else self.request_id
        heads, dim = cfg.num_heads, cfg.head_dim
        t1 = time.perf_counter()
        n_local, produced = self.keep, 1
        while True:
            if produced > 1 or yield_first:
                if token in ends:
                    if self.logits:
                        self.logits.pop()
                    break
                yield token
            if produced == self.max_tokens:
                break
            pos = len(prompt) + produced - 1
            x = model.embed_tokens(torch.tensor([token]))
            cos, sin = model.rope(torch.tensor([pos]), x.dtype)
            for i, layer in enumerate(model.layers):
                q, k, v = layer.qkv(x, cos, sin)
                kv.write(i, rows[n_local : n_local + 1], k, v)
                qb = _as_bytes(q[0])
                futures = [self._call(loan, "Attend", kvpool_pb2.AttendRequest(
                    request_id=wire_id, layer=i, q=qb, num_heads=heads)) for loan in loans]
                kc, vc = kv.gather(i, rows[: n_local + 1])
                parts = [micro_attention(q[0], kc, vc)]
                for fut in futures:
                    r = self._wait(fut)
                    parts.append(from_bytes(r.max, r.sum_exp, r.weighted, heads))
                out = merge(parts).to(x.dtype).reshape(1, heads * dim)
                x = layer.finish(x, out)
            n_local += 1
            produced += 1
            self.logits.append(model.lm_head(model.norm(x)).float()[0])
            token = int(self.logits[-1].argmax())
            self.decode_s = time.perf_counter() - t1
