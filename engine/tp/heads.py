"""Which KV heads each tensor-parallel rank holds, and whether two TP sizes may pair for P/D: plain arithmetic,
no torch (the decode's admission check imports it, and a sim server must stay small)."""

from __future__ import annotations


def kv_head_ranges(num_kv_heads: int, size: int) -> list[range]:
    """The KV heads each of ``size`` ranks holds: split evenly, or with fewer heads than ranks one head each,
    ``size / num_kv_heads`` ranks to a head (replicated)."""
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return [range(r * per, (r + 1) * per) for r in range(size)]
    return [range(r // (size // num_kv_heads), r // (size // num_kv_heads) + 1) for r in range(size)]


def pairing_error(num_kv_heads: int, prefill: int, decode: int) -> str | None:
    """Why a prefill of tensor-parallel size ``prefill`` and a decode of size ``decode`` serving a model of
    ``num_kv_heads`` KV heads may not pair, or None. The rule: every decode rank's KV heads and every prefill
    rank's either nest (one holds all of the other's) or do not meet, so that each rank's shard goes whole to,
    or comes whole from, the ranks of the other side (what a per-rank push needs: tp/transfer.py); it holds
    when one size divides the other and both split (or replicate) the heads."""
    sizes = f"prefill tensor-parallel size {prefill} and decode tensor-parallel size {decode}"
    for n in (prefill, decode):
        if n < 1 or (num_kv_heads % n and n % num_kv_heads):
            return f"{sizes}: {n} and the model's {num_kv_heads} KV heads do not divide one another"
    for d in kv_head_ranges(num_kv_heads, decode):
        for p in kv_head_ranges(num_kv_heads, prefill):
            meet = set(d) & set(p)
            if meet and meet != set(d) and meet != set(p):
                return (f"{sizes} do not divide one another: over the model's {num_kv_heads} KV heads a decode "
                        f"rank's heads {d.start}..{d.stop - 1} straddle prefill ranks' shards")
    return None
