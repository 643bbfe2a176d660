"""LLMEngine: continuous batching over a paged KV cache, plus the P/D hooks.

Colocated path (the baseline and the prefill server's local fallback)::

    engine.add_request(rid, prompt_ids, sampling)
    while engine.has_unfinished():
        for out in engine.step(): ...          # RequestOutput per request that produced something

Each ``step`` (1) gives every running sequence a slot for its next token, preempting the newest
colocated sequence (freeing its blocks; it is recomputed later) when blocks run out, (2) admits
waiting requests FIFO while blocks, ``max_num_seqs`` and the prefill token budget allow (a
request that does not fit waits; one that could never fit is refused by ``add_request``),
(3) runs ONE forward over all of them (prefills and decodes together) and samples.

P/D hooks (see ``engine/__init__.py`` for the full contract):

- prefill side: ``prefill_only`` computes a prompt's KV into local blocks, calling
  ``on_layer(layer_idx, block_ids)`` after each layer's KV is written, and returns the first
  token; the blocks stay held until ``release(request_id)``.
- decode side: ``reserve`` takes blocks for prompt + max_tokens up front (so the request is
  never preempted) or raises OutOfBlocksError; the KV is written into them from outside;
  ``add_prefilled`` joins the request to the running batch.

Not thread-safe: call from one thread (AsyncLLMEngine runs it on its own thread).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.defaults import BLOCK_SIZE

from .block_manager import BlockManager, blocks_needed
from .errors import OutOfBlocksError, PromptTooLongError
from .kv_cache import KVCache
from .loader import LoadedModel
from .model import ForwardBatch, PrefillSpan
from .sampling import Sampler, SamplingParams
from .sequence import RequestOutput, Sequence, Status


@dataclass(slots=True)
class EngineConfig:
    """Engine sizes. ``num_blocks=None``: as many blocks as ``kv_cache_bytes`` holds, at most
    enough for ``max_num_seqs`` full-length sequences. ``max_model_len=None``: the model's context."""

    num_blocks: int | None = None
    block_size: int = BLOCK_SIZE
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_cache: bool = True
    max_num_batched_tokens: int = 8192
    kv_cache_bytes: int = 1 << 30
    seed: int | None = None  # the sampler's generator for requests without their own seed
    detokenize: bool = True  # fill RequestOutput.text (stop strings work either way)

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {self.max_model_len}")


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None):
        config = config or EngineConfig()
        cfg = loaded.config
        self.loaded, self.config, self.model_config = loaded, config, cfg
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        if config.max_model_len is not None and config.max_model_len > cfg.context_length:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's context length {cfg.context_length}"
            )
        self.max_model_len = config.max_model_len or cfg.context_length
        self.block_size = config.block_size
        num_blocks = config.num_blocks
        if num_blocks is None:
            probe = KVCache(cfg.num_layers, 1, config.block_size, cfg.num_kv_heads, cfg.head_dim, loaded.dtype, "meta")
            by_memory = config.kv_cache_bytes // (probe.block_nbytes * cfg.num_layers)
            by_need = config.max_num_seqs * blocks_needed(self.max_model_len, config.block_size)
            num_blocks = max(1, min(by_memory, by_need))
        self.kv_cache = KVCache(
            cfg.num_layers, num_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim, loaded.dtype, loaded.device
        )
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_cache)
        self.sampler = Sampler(loaded.device, config.seed)
        self.device = loaded.device
        self.eos_ids = set(loaded.tokenizer.eos_token_ids) | set(cfg.eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._seqs: dict[str, Sequence] = {}  # waiting, running, or prefilled-and-held
        self._reserved: dict[str, list[int]] = {}
        self._done_early: list[Sequence] = []  # finished outside step(); reported by the next step
        self._arrivals = 0
        self.num_preemptions = 0  # colocated sequences freed and recomputed for lack of blocks

    # ---- public queries --------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._done_early)

    def num_requests(self) -> int:
        """Requests holding engine state: waiting, running, prefilled-and-held, or reserved."""
        return len(self._seqs) + len(self._reserved)

    # ---- colocated path --------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Queue a request. Raises PromptTooLongError, OutOfBlocksError (can never fit), ValueError."""
        seq = self._new_sequence(request_id, prompt_token_ids, sampling)
        need = blocks_needed(min(len(seq.prompt_ids) + sampling.max_tokens, self.max_model_len), self.block_size)
        if need > self.num_blocks:
            raise OutOfBlocksError(
                f"request {request_id!r} needs {need} KV blocks ({len(seq.prompt_ids)} prompt tokens + "
                f"max_tokens {sampling.max_tokens}) but the pool has only {self.num_blocks}"
            )
        self._seqs[request_id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """Forget a request wherever it is and free its blocks. False if unknown."""
        if request_id in self._reserved:
            self.block_manager.free(self._reserved.pop(request_id))
            return True
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self._done_early:
            self._done_early.remove(seq)
        self._free_blocks(seq)
        seq.status, seq.finish_reason = Status.FINISHED, "abort"
        return True

    def step(self) -> list[RequestOutput]:
        outputs = [self._output(seq) for seq in self._done_early]
        self._done_early.clear()
        decodes = self._schedule_decodes()
        prefills = self._schedule_prefills()
        batch_seqs = prefills + decodes
        if batch_seqs:
            self._run(batch_seqs)
        for seq in batch_seqs:
            if seq.status is Status.FINISHED:
                self.running.remove(seq)
                self._seqs.pop(seq.request_id, None)
                self._free_blocks(seq)
                outputs.append(self._output(seq))
            elif seq.pending_ids or seq.pending_text:
                outputs.append(self._output(seq))
        return outputs

    # ---- P/D: prefill side -----------------------------------------------------------------
    def prefill_only(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        on_layer: Callable[[int, list[int]], None] | None = None,
    ) -> int:
        """Compute the prompt's KV into local blocks and return the first generated token.

        ``on_layer(layer_idx, block_ids)`` is called on this thread right after each layer's
        KV is written; ``block_ids`` are all the prompt's blocks (prefix-cache hits included).
        The blocks stay held until ``release(request_id)``. Raises OutOfBlocksError when the
        prompt's blocks are not free now, PromptTooLongError, ValueError. On any error
        (including one raised by ``on_layer``) the blocks are freed before it propagates.
        """
        cb = None
        if on_layer is not None:
            cb = lambda layer, tables: on_layer(layer, tables[request_id])  # noqa: E731
        return self.prefill_many([(request_id, prompt_token_ids, sampling)], cb)[request_id]

    def prefill_many(
        self,
        requests: list[tuple[str, list[int], SamplingParams]],
        on_layer: Callable[[int, dict[str, list[int]]], None] | None = None,
    ) -> dict[str, int]:
        """``prefill_only`` for several prompts in ONE forward pass: request id -> first token.

        ``on_layer(layer_idx, {request_id: block_ids})`` after each layer's KV is written.
        All or nothing: if any prompt is invalid or its blocks are not free, nothing is held
        and the error propagates. Each request's blocks are held until ``release``.
        """
        seqs: list[Sequence] = []
        try:
            for request_id, ids, sampling in requests:
                if any(s.request_id == request_id for s in seqs):
                    raise ValueError(f"request id {request_id!r} appears twice")
                seq = self._new_sequence(request_id, ids, sampling)
                seq.block_table, seq.num_computed = self.block_manager.allocate(seq.prompt_ids, len(seq.prompt_ids))
                seq.num_cached_tokens = seq.num_computed
                seqs.append(seq)
            layer_cb = None
            if on_layer is not None:
                tables = {s.request_id: list(s.block_table) for s in seqs}
                layer_cb = lambda i: on_layer(i, tables)  # noqa: E731
            tokens = self._forward_and_sample(seqs, layer_cb) if seqs else []
        except BaseException:
            for seq in seqs:
                self.block_manager.free(seq.block_table)
            raise
        for seq in seqs:
            seq.num_computed = len(seq.prompt_ids)
            seq.status = Status.RUNNING
            self._seqs[seq.request_id] = seq
            self._register(seq)
        return {s.request_id: t for s, t in zip(seqs, tokens)}

    def prefill_block_ids(self, request_id: str) -> list[int]:
        """The blocks a prefill_only request holds (its prompt's KV)."""
        return list(self._seqs[request_id].block_table)

    def release(self, request_id: str) -> None:
        """Free the blocks of a prefill_only request (after its KV was sent). Unknown ids are ignored."""
        seq = self._seqs.get(request_id)
        if seq is not None and seq not in self.running and seq not in self.waiting:
            del self._seqs[request_id]
            self._free_blocks(seq)

    # ---- P/D: decode side ------------------------------------------------------------------
    def reserve(self, request_id: str, num_prompt_tokens: int, max_tokens: int) -> list[int]:
        """Take blocks for prompt + max_tokens now; the prompt's KV goes into the first
        ``ceil(num_prompt_tokens / block_size)`` of the returned ids. Raises OutOfBlocksError
        (with the reason) or PromptTooLongError. Freed by ``abort`` or when the request finishes."""
        if request_id in self._seqs or request_id in self._reserved:
            raise ValueError(f"request id {request_id!r} is already in use")
        if num_prompt_tokens < 1:
            raise ValueError(f"num_prompt_tokens must be >= 1, got {num_prompt_tokens}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if num_prompt_tokens + 1 > self.max_model_len:
            raise PromptTooLongError(num_prompt_tokens, self.max_model_len)
        n = min(num_prompt_tokens + max_tokens, self.max_model_len)
        table, _ = self.block_manager.allocate([], n, use_prefix_cache=False)
        self._reserved[request_id] = table
        return list(table)

    def add_prefilled(
        self, request_id: str, prompt_token_ids: list[int], first_token_id: int, sampling: SamplingParams
    ) -> None:
        """Join a reserved request whose prompt KV is in its blocks to the running batch.

        The first token was already reported by prefill: outputs start after it. If the first
        token already ends the request (EOS, stop, max_tokens=1), the next ``step`` reports it
        finished with no tokens and frees the blocks.
        """
        if request_id not in self._reserved:
            raise ValueError(f"request {request_id!r} has no reservation (call reserve first)")
        seq = self._new_sequence(request_id, prompt_token_ids, sampling, check_unique=False)
        table = self._reserved[request_id]
        if blocks_needed(len(seq.prompt_ids), self.block_size) > len(table):
            raise ValueError(f"request {request_id!r} reserved {len(table)} blocks, too few for {len(seq.prompt_ids)} prompt tokens")
        del self._reserved[request_id]
        seq.block_table, seq.reserved = table, True
        seq.num_computed = len(seq.prompt_ids)
        self._register(seq)
        self._seqs[request_id] = seq
        self._append_token(seq, first_token_id)
        seq.pending_ids.clear()
        seq.pending_text = ""
        if seq.status is Status.FINISHED:
            del self._seqs[request_id]
            self._free_blocks(seq)
            self._done_early.append(seq)
        else:
            seq.status = Status.RUNNING
            self.running.append(seq)

    # ---- scheduling ------------------------------------------------------------------------
    def _new_sequence(self, request_id, prompt_token_ids, sampling, check_unique=True) -> Sequence:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if check_unique and (request_id in self._seqs or request_id in self._reserved):
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("prompt must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(ids) + 1 > self.max_model_len:
            raise PromptTooLongError(len(ids), self.max_model_len)
        self._arrivals += 1
        seq = Sequence(request_id, ids, sampling, self._arrivals)
        if self.config.detokenize or sampling.stop:
            seq.detok = self.tokenizer.detokenizer()
        return seq

    def _schedule_decodes(self) -> list[Sequence]:
        scheduled = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted below
            while True:
                try:
                    self.block_manager.append_slots(seq.block_table, seq.num_tokens)
                    scheduled.append(seq)
                    break
                except OutOfBlocksError:
                    victim = self._pick_victim()
                    if victim is None:
                        raise  # cannot happen: add_request refuses what can never fit
                    self._preempt(victim)
                    if victim is seq:
                        break
                    if victim in scheduled:
                        scheduled.remove(victim)
        return scheduled

    def _pick_victim(self) -> Sequence | None:
        candidates = [s for s in self.running if not s.reserved and s.status is Status.RUNNING]
        return max(candidates, key=lambda s: s.arrival) if candidates else None

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self._free_blocks(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _schedule_prefills(self) -> list[Sequence]:
        scheduled, budget = [], self.config.max_num_batched_tokens
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            ids = seq.all_ids
            try:
                table, cached = self.block_manager.allocate(ids, len(ids))
            except OutOfBlocksError:
                break  # wait for blocks to free up
            if scheduled and len(ids) - cached > budget:
                self.block_manager.free(table)
                break
            self.waiting.popleft()
            budget -= len(ids) - cached
            seq.block_table, seq.num_computed = table, cached
            if not seq.output_ids:
                seq.num_cached_tokens = cached
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled.append(seq)
        return scheduled

    # ---- running the model -----------------------------------------------------------------
    def _run(self, seqs: list[Sequence]) -> None:
        tokens = self._forward_and_sample(seqs, None)
        for seq, token in zip(seqs, tokens):
            seq.num_computed = seq.num_tokens
            self._register(seq)
            self._append_token(seq, token)

    def _forward_and_sample(self, seqs: list[Sequence], on_layer) -> list[int]:
        # prefill spans first, then decode rows; remember the order to map logits back
        pre = [s for s in seqs if not (s.num_tokens - s.num_computed == 1 and s.num_computed > 0)]
        dec = [s for s in seqs if s not in pre] if len(pre) != len(seqs) else []
        batch = self._build_batch(pre, dec)
        logits = self.model(batch, self.kv_cache, on_layer=on_layer)
        ordered = pre + dec
        sampled = self.sampler.sample(logits, [s.sampling for s in ordered], [len(s.output_ids) for s in ordered])
        by_seq = {id(s): t for s, t in zip(ordered, sampled)}
        return [by_seq[id(s)] for s in seqs]

    def _build_batch(self, pre: list[Sequence], dec: list[Sequence]) -> ForwardBatch:
        bs, dev = self.block_size, self.device
        input_ids, positions, slots, spans, logits_rows = [], [], [], [], []
        for seq in pre:
            start = len(input_ids)
            ids = seq.all_ids
            table = seq.block_table
            for p in range(seq.num_computed, len(ids)):
                input_ids.append(ids[p])
                positions.append(p)
                slots.append(table[p // bs] * 2 * bs + p % bs)
            rows = None
            if seq.num_computed > 0:
                rows = torch.tensor([table[p // bs] * 2 * bs + p % bs for p in range(len(ids))], device=dev)
            spans.append(PrefillSpan(start, len(input_ids), seq.num_computed, rows))
            logits_rows.append(len(input_ids) - 1)
        decode_start = len(input_ids)
        decode_rows = decode_mask = None
        if dec:
            max_blocks = max(len(s.block_table) for s in dec)
            tables, ctx = [], []
            for seq in dec:
                p = seq.num_computed
                input_ids.append(seq.all_ids[p])  # the last token
                positions.append(p)
                slots.append(seq.block_table[p // bs] * 2 * bs + p % bs)
                tables.append(seq.block_table + [0] * (max_blocks - len(seq.block_table)))
                ctx.append(p + 1)
                logits_rows.append(len(input_ids) - 1)
            max_ctx = max(ctx)
            table_t = torch.tensor(tables, device=dev)
            decode_rows = self.kv_cache.table_rows(table_t)[:, :max_ctx]
            ctx_t = torch.tensor(ctx, device=dev)
            decode_mask = (torch.arange(max_ctx, device=dev) < ctx_t.unsqueeze(1)).view(len(dec), 1, 1, max_ctx)
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, device=dev),
            positions=torch.tensor(positions, device=dev),
            slot_rows=torch.tensor(slots, device=dev),
            prefills=spans,
            decode_start=decode_start,
            decode_rows=decode_rows,
            decode_mask=decode_mask,
            logits_rows=torch.tensor(logits_rows, device=dev),
        )

    # ---- tokens, stops, outputs ------------------------------------------------------------
    def _append_token(self, seq: Sequence, token: int) -> None:
        sp = seq.sampling
        if (not sp.ignore_eos and token in self.eos_ids) or token in sp.stop_token_ids:
            self._finish(seq, "stop")
            return
        seq.append_output(token)
        seq.pending_ids.append(token)
        if seq.detok is not None:
            seq.detok.add([token])
            text = seq.detok.text
            if sp.stop:
                cut = min((i for i in (text.find(s) for s in sp.stop) if i >= 0), default=-1)
                if cut >= 0:
                    seq.pending_text += text[seq.emitted_len : cut]
                    seq.emitted_len = cut
                    self._finish(seq, "stop")
                    return
                hold = _stop_prefix_len(text, sp.stop)
                end = max(seq.emitted_len, len(text) - hold)
            else:
                end = len(text)
            seq.pending_text += text[seq.emitted_len : end]
            seq.emitted_len = end
        if len(seq.output_ids) >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if seq.detok is not None and reason != "stop":
            seq.detok.flush()
            seq.pending_text += seq.detok.text[seq.emitted_len :]
            seq.emitted_len = len(seq.detok.text)

    def _output(self, seq: Sequence) -> RequestOutput:
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=seq.pending_ids,
            finished=seq.status is Status.FINISHED,
            finish_reason=seq.finish_reason if seq.status is Status.FINISHED else None,
            text=seq.pending_text,
            num_prompt_tokens=len(seq.prompt_ids),
            num_cached_tokens=seq.num_cached_tokens,
        )
        seq.pending_ids, seq.pending_text = [], ""
        return out

    def _register(self, seq: Sequence) -> None:
        if seq.num_computed // self.block_size <= len(seq.block_hashes):
            return  # no block became full since the last call
        self.block_manager.register_full_blocks(seq.block_table, seq.block_hashes, seq.num_computed, seq.all_ids)

    def _free_blocks(self, seq: Sequence) -> None:
        if seq.block_table:
            self.block_manager.free(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
