"""The prefill's per-rank push: one CacheStore sender per tensor-parallel rank, each on that rank's pool, and one
per head slice that a decode rank needs of a rank's shard.

With ``--kv-push per-rank`` (the default) a prefill's Start says which per-rank push it speaks
(``Compat.kv_push``, ``protos/version.py`` KV_PUSH_VERSION); a decode that pairs answers with one ``RankTarget``
per *piece* (``engine/tp/heads.py`` rank_pieces: heads of one decode rank from one prefill rank holding them;
``decode_server/rank_receivers.py``). Each piece is sent, whole blocks of every layer, by the prefill rank it
names, on that rank's own sender (its links, its NIXL agent; the compat names the heads, so a piece never binds
to a receiver of other heads):

- the piece is the rank's whole shard (equal sizes, TP 2 into TP 1, replicated heads): straight from its pool;
- the piece is a slice of it (2 KV heads from TP 1 into TP 2): after each layer the slice of the pushed blocks is
  packed contiguous into the slice's staging pool (``engine/tp/pieces.py`` HeadSlice, made at the first request
  that needs it), which the slice's own sender reads; the decode rank gets exactly the heads it holds.

The engine's ranks only sync after each layer (``engine/tp/rank_pools.py``): no gather to rank 0. Without rank
targets the one sender on rank 0's transfer pool (every KV head) sends, as before.

``parts`` turns an Allocation into the session's destinations (``decode_session.Part``: one per piece); ``sent``
counts a rank's piece delivered whole (``/health``'s ``kv_push.shards_sent``: which path was used; ``sliced``:
pieces packed from part of a shard).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, Callable

from pdserve.engine.tp.heads import kv_head_ranges

if TYPE_CHECKING:
    from pdserve.cachestore import CacheStoreSender
    from pdserve.engine.tp.pieces import HeadSlice
    from pdserve.protos import session_pb2 as pb

# (our rank, the heads) -> the slice's staging pool and its started sender (wiring.start_rank_senders)
MakeSlice = Callable[[int, range], Awaitable[tuple["HeadSlice", "CacheStoreSender"]]]


@dataclass(frozen=True, slots=True)
class Part:
    """One destination of a request's KV: the id it is bound under, the decode's endpoint and blocks there, our
    prompt blocks [start, end) that go there, the sender that sends them (our rank ``rank``'s), and ``pack`` (a
    slice of the rank's heads: copies a layer's blocks into the slice's staging pool before they are stored)."""

    request_id: str
    endpoint: bytes
    dst: list[int]
    start: int
    end: int
    sender: CacheStoreSender
    rank: int = 0
    per_rank: bool = False  # one decode rank's heads (a RankTarget), not every head
    pack: Callable[[int, list[int]], None] | None = None


@dataclass(slots=True)
class RankSenders:
    """Every rank's sender, in rank order (at size 1 the sender itself), the model's KV heads, and the head slices'
    senders made so far (``make_slice``: None where slices are not offered, e.g. a GPU pool)."""

    senders: list[CacheStoreSender]
    num_kv_heads: int
    make_slice: MakeSlice | None = None
    slices: dict[tuple[int, int, int], tuple[HeadSlice, CacheStoreSender]] = field(default_factory=dict)
    shards_sent: list[int] = field(default_factory=list)  # pieces delivered whole, per rank of ours
    sliced: int = 0  # pieces delivered that were a slice of a rank's shard (packed)
    whole_heads: int = 0  # requests whose KV went with every head on the one sender (rank 0's transfer pool at N > 1)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        self.shards_sent = [0] * len(self.senders)

    @property
    def all_senders(self) -> list[CacheStoreSender]:
        """The ranks' senders and the slices' (for stats and stop)."""
        return self.senders + [sender for _, sender in self.slices.values()]

    async def parts(self, alloc: pb.Allocation) -> list[Part]:
        """One part per piece of ``alloc.rank_targets``: the same blocks, from the rank of ours it names, its whole
        shard or a slice. ValueError when a target names a rank we do not have or heads it does not hold."""
        ours = kv_head_ranges(self.num_kv_heads, len(self.senders))
        first, dst, parts = alloc.cached_blocks, list(alloc.block_ids), []
        for t in alloc.rank_targets:
            rank, heads = t.prefill_rank, range(t.first_kv_head, t.first_kv_head + t.num_kv_heads)
            if not 0 <= rank < len(ours) or not heads or not set(heads) <= set(ours[rank]):
                raise ValueError(f"a rank target asks for KV heads {heads.start}..{heads.stop - 1} from our rank "
                                 f"{rank}, which does not hold them ({len(ours)} ranks over {self.num_kv_heads} KV "
                                 "heads)")
            sender, pack = self.senders[rank], None
            if heads != ours[rank]:
                staged, sender = await self._slice(rank, heads)
                pack = staged.pack
            parts.append(Part(t.request_id, t.cachestore_endpoint, dst, first, first + len(dst), sender, rank, True,
                              pack))
        return parts

    async def _slice(self, rank: int, heads: range) -> tuple[HeadSlice, CacheStoreSender]:
        """The staging pool and sender of heads ``heads`` of our rank ``rank``, made at first use."""
        key = (rank, heads.start, heads.stop)
        async with self._lock:
            if key not in self.slices:
                if self.make_slice is None:
                    raise ValueError(f"this prefill does not send part of a rank's KV heads (heads {heads.start}.."
                                     f"{heads.stop - 1} of rank {rank}): its pools are not on the CPU")
                self.slices[key] = await self.make_slice(rank, heads)
            return self.slices[key]

    def sent(self, parts: list[Part]) -> None:
        """Every part of a request delivered: one piece per part counted for the rank that sent it."""
        for part in parts:
            self.shards_sent[part.rank] += 1
            self.sliced += part.pack is not None

    def state(self) -> dict:
        return {"ranks": len(self.senders), "shards_sent": list(self.shards_sent), "sliced": self.sliced,
                "slices": len(self.slices), "whole_heads": self.whole_heads}
