"""The prefill's per-rank push: one CacheStore sender per tensor-parallel rank, each on that rank's pool.

With ``--kv-push per-rank`` (the default) a prefill's Start says it speaks the per-rank push
(``Compat.kv_push``); a decode that pairs answers with one ``RankTarget`` per decode rank
(``decode_server/rank_receivers.py``). Each decode rank's heads are then sent, whole blocks of every layer, by
the prefill rank holding exactly those heads (``engine/tp/heads.py`` rank_sources), from that rank's own pool on
that rank's own sender (its links, its NIXL agent; its compat names the rank's KV heads, so a shard never binds
to a receiver of other heads): a decode rank of a TP 2 prefill gets rank 0's or rank 1's shard, a TP 1
prefill's one sender feeds every decode rank of a model whose KV heads they replicate. The engine's ranks only
sync after each layer (``engine/tp/rank_pools.py``): no gather to rank 0. Without rank targets the one sender on
rank 0's transfer pool (every KV head) sends, as before.

``parts`` turns an Allocation into the session's destinations (``decode_session.Part``: one per decode rank);
``sent`` counts a rank's shard delivered whole (``/health``'s ``kv_push.shards_sent``: which path was used).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.tp.heads import rank_sources

if TYPE_CHECKING:
    from pdserve.cachestore import CacheStoreSender
    from pdserve.protos import session_pb2 as pb


@dataclass(frozen=True, slots=True)
class Part:
    """One destination of a request's KV: the id it is bound under, the decode's endpoint and blocks there, our
    prompt blocks [start, end) that go there, the sender that sends them (our rank ``rank``'s)."""

    request_id: str
    endpoint: bytes
    dst: list[int]
    start: int
    end: int
    sender: CacheStoreSender
    rank: int = 0
    per_rank: bool = False  # one decode rank's heads (a RankTarget), not every head


@dataclass(slots=True)
class RankSenders:
    """Every rank's sender, in rank order (at size 1 the sender itself), and the model's KV heads."""

    senders: list[CacheStoreSender]
    num_kv_heads: int
    shards_sent: list[int] = field(default_factory=list)  # shards delivered whole, per rank of ours
    whole_heads: int = 0  # requests whose KV went with every head on the one sender (rank 0's transfer pool at N > 1)

    def __post_init__(self) -> None:
        self.shards_sent = [0] * len(self.senders)

    def parts(self, alloc: pb.Allocation) -> list[Part]:
        """One part per decode rank of ``alloc.rank_targets``: the same blocks, from the rank of ours holding its
        heads. ValueError when our heads do not pair with that many decode ranks (the decode should not have
        offered it)."""
        sources = rank_sources(self.num_kv_heads, len(self.senders), len(alloc.rank_targets))
        if sources is None:
            raise ValueError(f"{len(alloc.rank_targets)} decode ranks do not pair rank for rank with our "
                             f"{len(self.senders)} over {self.num_kv_heads} KV heads")
        first, dst = alloc.cached_blocks, list(alloc.block_ids)
        return [Part(t.request_id, t.cachestore_endpoint, dst, first, first + len(dst), self.senders[src], src, True)
                for t, src in zip(alloc.rank_targets, sources)]

    def sent(self, parts: list[Part]) -> None:
        """Every part of a request delivered: one shard per part counted for the rank that sent it."""
        for part in parts:
            self.shards_sent[part.rank] += 1

    def state(self) -> dict:
        return {"ranks": len(self.senders), "shards_sent": list(self.shards_sent), "whole_heads": self.whole_heads}
