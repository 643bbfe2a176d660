"""ModelRunner: sequences -> one ForwardBatch -> one forward pass -> one sampled token each.

Owns the tensors side of a step: the model, the KV cache, the sampler. It never changes a
Sequence; the caller (LLMEngine, the P/D hooks) decides which sequences run and what to do
with the tokens.

A sequence is a *decode* row when exactly one of its tokens is not yet in the cache and some
are (``num_tokens - num_computed == 1 and num_computed > 0``); every other sequence is a
*prefill* span: its ``num_new`` uncomputed tokens (a chunk, set by the scheduler; 0: all of
them). Prefill spans come first in the batch, then decode rows; ``forward_and_sample`` hands
the tokens back in the caller's order. A span that stops before the sequence's last token (a
chunk before the last) has no logits row and samples nothing (None).

The forward itself is ``steps.run(batch, extra_rows, on_layer, on_rows)``: ``LocalSteps`` (this process's
model), or with tensor parallelism ``tp.ranks.TensorParallelSteps`` (the batch sent to every rank first).

A step of decode rows only, without a layer callback, runs from ``graphs`` (CUDA graphs, one
per batch-size bucket: ``decode_graphs.py``) when set and the rows fit.

Prompt logprobs (``SamplingParams.prompt_logprobs``, a sequence whose ``needs_prompt_logits``):
the logits of every position of its prefill span are made too (from the last hidden states,
``ROWS_PER_PASS`` rows at a time), so position p gives the logprob of prompt token p + 1. Its
span must start where its prompt logprobs so far end (the scheduler and ``prefill_many`` give
such a sequence no prefix-cache hit).

Token ``t`` of a sequence is written to K row ``kv_cache.slot_indices(block_table[t //
block_size], t % block_size)`` (see ``kv_cache.py``).
"""

from __future__ import annotations

from typing import Callable

import torch

from . import attention_backends
from .decode_graphs import DecodeGraphs, DecodeRow
from .kv_cache import KVCache
from .model import DecoderModel, ForwardBatch, PrefillSpan
from .sampling import ROWS_PER_PASS, Sampler, logprobs_of, token_logprobs
from .sequence import Sequence


class LocalSteps:
    """The forward of a step in this process (tensor-parallel size 1)."""

    def __init__(self, model: DecoderModel, kv_cache: KVCache):
        self.model, self.kv = model, kv_cache

    def run(self, batch: ForwardBatch, extra_rows, on_layer, on_rows) -> torch.Tensor:
        return self.model(batch, self.kv, on_layer, extra_rows, on_rows)

    def close(self) -> None:
        pass


class ModelRunner:
    def __init__(self, model: DecoderModel, kv_cache: KVCache, sampler: Sampler, device: torch.device,
                 native_kernels: bool = True, steps=None):
        self.model, self.kv_cache, self.sampler, self.device = model, kv_cache, sampler, device
        self.steps = steps or LocalSteps(model, kv_cache)  # runs each step's forward (tp/ranks.py with TP)
        self.graphs: DecodeGraphs | None = None  # pure-decode steps from CUDA graphs (LLMEngine sets it on CUDA)
        # the attention backend, chosen once (attention_backends.py: triton, native or torch)
        self.attention = attention_backends.choose(kv_cache, device, native_kernels)

    def forward_and_sample(self, seqs: list[Sequence], on_layer: Callable[[int], None] | None) -> list[int]:
        """One forward over ``seqs`` (their uncomputed tokens) and one sampled token per sequence,
        in the order of ``seqs``. ``on_layer(layer_idx)`` runs after each layer's KV is written."""
        return self.forward_sample(seqs, on_layer)[0]

    def forward_sample(self, seqs: list[Sequence], on_layer: Callable[[int], None] | None):
        """``forward_and_sample`` plus, per sequence, its token's TokenLogprob (None where the request did
        not ask) and its new prompt logprobs (a list continuing ``seq.prompt_logprobs``, starting with None
        for the first prompt token; None where not asked). A sequence with a grammar matcher samples only
        among the tokens it allows next. A sequence whose chunk stops before its last token samples
        nothing: its token and logprob are None."""
        pre = [s for s in seqs if not _decode_row(s)]
        dec = [s for s in seqs if s not in pre] if len(pre) != len(seqs) else []
        ordered = [s for s in pre if _completes(s)] + dec  # the rows that sample, in the batch's order
        logits, prompt_lps = self._forward(pre, dec, on_layer)
        by_seq: dict[int, tuple] = {}
        if ordered:
            params = [s.sampling for s in ordered]
            masked = logits
            if any(s.matcher is not None for s in ordered):
                masked = logits.float()  # a copy (the raw logits stay for the logprobs)
                if masked.data_ptr() == logits.data_ptr():
                    masked = masked.clone()
                for row, s in enumerate(ordered):
                    if s.matcher is not None:
                        s.matcher.mask(masked[row])
            sampled = self.sampler.sample(masked, params, [len(s.output_ids) for s in ordered])
            lps = token_logprobs(logits, params, sampled)
            by_seq = {id(s): (t, lp) for s, t, lp in zip(ordered, sampled, lps)}
        none = (None, None)
        return ([by_seq.get(id(s), none)[0] for s in seqs], [by_seq.get(id(s), none)[1] for s in seqs],
                [prompt_lps.get(id(s)) for s in seqs])

    def _forward(self, pre: list[Sequence], dec: list[Sequence], on_layer) -> tuple[torch.Tensor, dict[int, list]]:
        """Logits of every sequence (prefills, then decodes) and the new prompt logprobs by id(sequence)."""
        if not pre and on_layer is None and self.graphs is not None:
            rows = [self._decode_row(s) for s in dec]
            if self.graphs.fits(rows):  # a CUDA graph of the step's bucket (decode_graphs.py)
                with torch.inference_mode():
                    return self.graphs.run(rows), {}
        batch = self.build_batch(pre, dec)
        prompt_rows = self._prompt_rows(pre, batch)
        extra_rows, on_rows, found = self._prompt_parts(prompt_rows)
        logits = self.steps.run(batch, extra_rows, on_layer, on_rows)
        return logits, self._prompt_logprobs(prompt_rows, found)

    def _decode_row(self, seq: Sequence) -> DecodeRow:
        p, bs = seq.num_computed, self.kv_cache.block_size
        return DecodeRow(seq.all_ids[p], p, int(self.kv_cache.slot_indices(seq.block_table[p // bs], p % bs)),
                         seq.block_table)

    @staticmethod
    def _prompt_rows(pre: list[Sequence], batch: ForwardBatch) -> list[tuple[Sequence, list[int], list[int]]]:
        """(sequence, batch rows, the prompt tokens they predict) of each prefill span whose prompt logprobs
        are wanted: position p of the span predicts prompt token p + 1."""
        out = []
        for seq, span in zip(pre, batch.prefills):
            if not seq.needs_prompt_logits:
                continue
            done, n_prompt = seq.num_computed, len(seq.prompt_ids)
            have = len(seq.prompt_logprobs or ())
            if have != (done + 1 if done else 0):
                raise RuntimeError(f"request {seq.request_id!r}: its prefill starts at position {done} but its prompt "
                                   f"logprobs reach token {have}: a skipped position has no logits")
            positions = range(done, min(n_prompt - 1, done + span.end - span.start))
            out.append((seq, [span.start + p - done for p in positions], [seq.prompt_ids[p + 1] for p in positions]))
        return out

    def _prompt_parts(self, prompt_rows):
        """The rows whose logits the prompt logprobs need, ``ROWS_PER_PASS`` at a time (a long prompt's
        [tokens, vocab] never exists at once), the ``on_rows(i, logits)`` that turns part ``i``'s logits into
        logprobs, and the list it fills, in order."""
        rows = [r for _, rs, _ in prompt_rows for r in rs]
        targets = [t for _, _, ts in prompt_rows for t in ts]
        ks = [seq.sampling.prompt_logprobs for seq, _, ts in prompt_rows for _ in ts]
        starts = range(0, len(rows), ROWS_PER_PASS)
        parts = [torch.tensor(rows[s : s + ROWS_PER_PASS], dtype=torch.long, device=self.device) for s in starts]
        found: list = []

        def on_rows(i: int, logits: torch.Tensor) -> None:
            s = starts[i]
            found.extend(logprobs_of(logits, targets[s : s + ROWS_PER_PASS], ks[s : s + ROWS_PER_PASS]))

        return parts, on_rows, found

    @staticmethod
    def _prompt_logprobs(prompt_rows, found: list) -> dict[int, list]:
        """id(sequence) -> its new prompt logprobs, from ``found`` (every prompt row's, in order)."""
        out, at = {}, 0
        for seq, _, ts in prompt_rows:
            out[id(seq)] = ([None] if seq.num_computed == 0 else []) + found[at : at + len(ts)]
            at += len(ts)
        return out

    def build_batch(self, pre: list[Sequence], dec: list[Sequence]) -> ForwardBatch:
        """The ForwardBatch of prefill spans ``pre`` then decode rows ``dec``."""
        dev = self.device
        kernels = attention_backends.backend(self.attention).reads_tables
        input_ids: list[int] = []
        positions: list[int] = []
        slot_parts: list[torch.Tensor] = []
        logits_rows: list[int] = []
        spans = [self._prefill_span(seq, kernels, input_ids, positions, slot_parts, logits_rows) for seq in pre]
        decode_start = len(input_ids)
        decode_rows = decode_mask = table_t = ctx_t = None
        if dec:
            bs = self.kv_cache.block_size
            max_blocks = max(len(s.block_table) for s in dec)
            tables, ctx, blocks, offsets = [], [], [], []
            for seq in dec:
                p = seq.num_computed
                input_ids.append(seq.all_ids[p])  # the last token
                positions.append(p)
                blocks.append(seq.block_table[p // bs])
                offsets.append(p % bs)
                tables.append(seq.block_table + [0] * (max_blocks - len(seq.block_table)))
                ctx.append(p + 1)
                logits_rows.append(len(input_ids) - 1)
            slot_parts.append(self.kv_cache.slot_indices(torch.tensor(blocks), torch.tensor(offsets)))
            max_ctx = max(ctx)
            table_t, ctx_t = torch.tensor(tables, device=dev), torch.tensor(ctx, device=dev)
            if not kernels:  # the kernels read the tables; attention.py gathers these rows
                decode_rows = self.kv_cache.table_rows(table_t)[:, :max_ctx]
                decode_mask = (torch.arange(max_ctx, device=dev) < ctx_t.unsqueeze(1)).view(len(dec), 1, 1, max_ctx)
        prefill_tables = None
        if kernels and pre:
            width = max(len(s.block_table) for s in pre)
            prefill_tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in pre], device=dev)
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, device=dev),
            positions=torch.tensor(positions, device=dev),
            slot_rows=torch.cat(slot_parts).to(dev),
            prefills=spans,
            decode_start=decode_start,
            decode_rows=decode_rows,
            decode_mask=decode_mask,
            logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=dev),
            decode_tables=table_t,
            decode_ends=ctx_t,
            attention=self.attention,
            prefill_tables=prefill_tables,
            prefill_ctx_lens=[sp.num_cached + sp.end - sp.start for sp in spans] if kernels else None,
        )

    def _prefill_span(self, seq: Sequence, kernels: bool, input_ids: list[int], positions: list[int],
                      slot_parts: list[torch.Tensor], logits_rows: list[int]) -> PrefillSpan:
        """One prefill span's tokens, positions, KV rows and (its prompt's last chunk) logits row, appended."""
        start, done, end = len(input_ids), seq.num_computed, seq.chunk_end
        input_ids.extend(seq.all_ids[done:end])
        positions.extend(range(done, end))
        context_rows = None
        if done > 0 and not kernels:  # a prefix hit or an earlier chunk: attention reads those rows too
            rows = self._token_rows(seq.block_table, 0, end)
            slot_parts.append(rows[done:])
            context_rows = rows.to(self.device)
        else:
            slot_parts.append(self._token_rows(seq.block_table, done, end))
        samples = end == seq.num_tokens  # the prompt's last chunk: its last position samples
        if samples:
            logits_rows.append(len(input_ids) - 1)
        return PrefillSpan(start, len(input_ids), done, context_rows, samples)

    def _token_rows(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """K rows (CPU, long) of tokens ``start .. end-1`` of a sequence with ``block_table``."""
        pos = torch.arange(start, end)
        bs = self.kv_cache.block_size
        return self.kv_cache.slot_indices(torch.tensor(block_table)[pos // bs], pos % bs)


def _completes(seq: Sequence) -> bool:
    """The span reaches the sequence's last token: its last position samples the next one."""
    return seq.chunk_end >= seq.num_tokens


def _decode_row(seq: Sequence) -> bool:
    return seq.num_tokens - seq.num_computed == 1 and seq.num_computed > 0
