"""Which KV heads each tensor-parallel rank holds, whether two TP sizes may pair for P/D, and which prefill rank
pushes each decode rank which of its heads (the per-rank push's pieces): plain arithmetic,
no torch (the decode's admission check imports it, and a sim server must stay small)."""

from __future__ import annotations

from dataclasses import dataclass


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


def rank_sources(num_kv_heads: int, prefill: int, decode: int) -> list[int] | None:
    """The per-rank push's version-1 plan (``protos/version.py`` KV_PUSH_VERSION 1, whole shards only; version 2
    is ``rank_pieces``): for each decode rank, the prefill rank that sends it its KV heads, whole blocks from that
    rank's pool into the decode rank's; None when some decode rank's heads are not exactly one prefill rank's (e.g.
    2 heads from TP 1 into TP 2: a decode rank needs a slice, which version 1 does not move). Equal
    sizes pair rank to rank; fewer KV heads than ranks (replicated heads) pair whatever the sizes: a head held
    by several prefill ranks is sent by one of them, spread over them round robin."""
    if pairing_error(num_kv_heads, prefill, decode) is not None:
        return None
    ours = kv_head_ranges(num_kv_heads, prefill)
    sources = []
    for d, heads in enumerate(kv_head_ranges(num_kv_heads, decode)):
        holders = [p for p, theirs in enumerate(ours) if theirs == heads]
        if not holders:
            return None
        sources.append(holders[d % len(holders)])
    return sources


@dataclass(frozen=True, slots=True)
class Piece:
    """One move of the per-rank push (KV_PUSH_VERSION 2): KV heads ``heads`` (the model's numbering) of every pushed
    block, from prefill rank ``prefill_rank`` to decode rank ``decode_rank``. ``whole_source``: the heads are the
    prefill rank's whole shard (sent straight from its pool), else a slice of it (packed contiguous first);
    ``whole_dest``: they are the decode rank's whole shard (landing straight in its pool), else a slice of it
    (landing in a staging pool, unpacked into the rank's pool before the request joins the batch)."""

    decode_rank: int
    prefill_rank: int
    heads: range
    whole_source: bool
    whole_dest: bool


def rank_pieces(num_kv_heads: int, prefill: int, decode: int) -> list[Piece] | None:
    """Every move of the per-rank push between a prefill of ``prefill`` ranks and a decode of ``decode``, in decode
    rank order then head order: each decode rank gets each of its heads exactly once, from a prefill rank holding
    it (a head held by several prefill ranks, replicated: one of them, round robin over the decode ranks, as
    ``rank_sources``). None when the sizes do not pair (``pairing_error``). Where the shards nest, a decode rank's
    heads are either inside one prefill rank's shard (one piece, a slice of that shard when smaller: e.g. 2 KV
    heads from TP 1 into TP 2) or the union of several prefill ranks' shards (one piece from each: TP 2 into
    TP 1)."""
    if pairing_error(num_kv_heads, prefill, decode) is not None:
        return None
    ours, theirs = kv_head_ranges(num_kv_heads, prefill), kv_head_ranges(num_kv_heads, decode)
    pieces = []
    for d, heads in enumerate(theirs):
        holders = [p for p, shard in enumerate(ours) if shard.start <= heads.start and heads.stop <= shard.stop]
        if holders:  # inside one prefill rank's shard (several: replicated heads)
            p = holders[d % len(holders)]
            pieces.append(Piece(d, p, heads, ours[p] == heads, True))
            continue
        for shard in sorted({s for s in ours if heads.start <= s.start and s.stop <= heads.stop},
                            key=lambda r: r.start):
            holding = [p for p, s in enumerate(ours) if s == shard]
            pieces.append(Piece(d, holding[d % len(holding)], shard, True, False))
    return pieces
