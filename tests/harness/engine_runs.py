"""Helpers for the engine tests that drive an LLMEngine synchronously (no server, no thread).

- ``run_all(engine, requests)`` runs requests to completion on the colocated path.
- ``record_step_logits(engine, limit)`` makes the engine's sampler keep each step's logits (a list it fills).
- ``greedy_with_first_logits(engine, prompts, n_tokens)`` greedy tokens per prompt and the first step's logits.
- ``copy_prompt_kv(src, src_blocks, dst, dst_blocks, n_tokens)`` copies a prompt's KV between
  two engines' pools block by block, layer by layer: what the CacheStore does for P/D.
- ``run_pd(prefill_engine, decode_engine, requests, reuse=False)`` runs requests the P/D way in
  one process; ``reuse``: the decode reserves with ``reserve_prefix`` and only the blocks after
  its cached prefix are copied (``last_moved`` records how many per request).
"""

from __future__ import annotations

from pdserve.engine import LLMEngine, SamplingParams, blocks_needed


def run_all(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    """Add every request, step until done; request id -> generated token ids."""
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    for rid, (ids, sp) in requests.items():
        engine.add_request(rid, ids, sp)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return out


def record_step_logits(engine: LLMEngine, limit: int | None = None) -> list:
    """Wrap ``engine``'s sampler so that each step's logits (rows in the batch's order) are kept, the first
    ``limit`` steps' only when given; the list."""
    seen = []
    real_sample = engine.sampler.sample

    def recording_sample(logits, params, positions):
        if limit is None or len(seen) < limit:
            seen.append(logits.clone())
        return real_sample(logits, params, positions)

    engine.sampler.sample = recording_sample
    return seen


def greedy_with_first_logits(engine: LLMEngine, prompts: list[list[int]], n_tokens: int):
    """(greedy tokens per prompt, the first step's logits [prompts, vocab] in float32), ignoring EOS."""
    seen = record_step_logits(engine, limit=1)
    sp = SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True)
    out = run_all(engine, {str(i): (p, sp) for i, p in enumerate(prompts)})
    return [out[str(i)] for i in range(len(prompts))], seen[0].float()


def copy_layer_blocks(src: LLMEngine, src_blocks: list[int], dst: LLMEngine, dst_blocks: list[int], layer: int) -> None:
    """Copy one layer of ``src_blocks`` of ``src``'s pool into ``dst_blocks`` of ``dst``'s pool (the pools KV
    moves through: a tensor-parallel engine's transfer pool, ``LLMEngine.transfer_cache``)."""
    for s, d in zip(src_blocks, dst_blocks):
        dst.transfer_cache.layer(layer)[d].copy_(src.transfer_cache.layer(layer)[s])


last_moved: dict[str, int] = {}  # request id -> prompt blocks copied by the last run_pd


def run_pd(
    prefill: LLMEngine, decode: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], reuse: bool = False
) -> dict[str, list[int]]:
    """Each request: reserve on decode, prefill_only with a per-layer copy, release, add_prefilled."""
    out: dict[str, list[int]] = {}
    for rid, (ids, sp) in requests.items():
        if reuse:
            dst, cached = decode.pd.reserve_prefix(rid, ids, sp.max_tokens)
        else:
            dst, cached = decode.pd.reserve(rid, len(ids), sp.max_tokens), 0
        c, n = cached // decode.block_size, blocks_needed(len(ids), prefill.block_size)
        last_moved[rid] = n - c
        def on_layer(layer: int, src: list[int], first: int, c=c, dst=dst) -> None:  # blocks [first, first+len)
            lo = max(c, first)
            if lo < first + len(src):
                copy_layer_blocks(prefill, src[lo - first:], decode, dst[lo:first + len(src)], layer)

        first = prefill.pd.prefill_only(rid, ids, sp, on_layer=on_layer)
        prefill.pd.release(rid)
        decode.pd.add_prefilled(rid, ids, first, sp)
        finished_at_first = (not sp.ignore_eos and first in decode.eos_ids) or first in sp.stop_token_ids
        out[rid] = [] if finished_at_first else [first]
    while decode.has_unfinished():
        for o in decode.step():
            out[o.request_id].extend(o.new_token_ids)
    return out
