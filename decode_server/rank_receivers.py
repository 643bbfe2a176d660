"""The decode's per-rank push: one CacheStore receiver per tensor-parallel rank, each on that rank's pool.

With ``--kv-push per-rank`` (the default) a decode offers each prefill that speaks the same per-rank push
(``Start.compat.kv_push`` equal to ``protos/version.py`` KV_PUSH_VERSION) and whose KV heads pair with ours
rank for rank (``engine/tp/heads.py`` rank_sources) an ``Allocation`` with one ``RankTarget`` per rank of
ours: that rank's receiver endpoint (its own port, ``--kv-port`` + 1 + rank, or NIXL agent; its compat names
the rank's KV heads) and its bind token, under the request id ``<rid>/rank<r>``. Each prefill rank then
pushes its head shard of the prompt blocks straight into the pools of the ranks holding those heads; every
rank's receiver counts every block of every layer, checksum per slice (so per shard), and the request is
admitted to the batch only when every rank's entry is complete (``wait_all``), with no scatter from rank 0
(``LLMEngine.kv_landed``). Otherwise (an older prefill, ``--kv-push gather`` on either end, heads that pair
only through rank 0) the session uses the one receiver on rank 0's transfer pool, as before.

A TP 1 decode has one rank: its receiver is the ordinary one (its pool holds every head), so a TP 2 prefill
can push rank by rank into it where the heads pair (replicated KV heads). Between two TP 1 servers it is never
offered (one shard of every head: the ordinary path, unchanged).

``RankArrival`` is what one session holds: the targets it expected, and the waits and clean-up over all of
them (the same calls the session makes on a single receiver: ``load``, ``wait_all``, ``delete``,
``released``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from pdserve.engine.tp.heads import rank_sources
from pdserve.protos import session_pb2 as pb
from pdserve.protos.version import KV_PUSH_VERSION

if TYPE_CHECKING:
    from pdserve.cachestore import CacheStoreReceiver


def rank_request_id(request_id: str, rank: int) -> str:
    """The id a rank's receiver expects a request's shard under (the prefill binds it from the RankTarget)."""
    return f"{request_id}/rank{rank}"


@dataclass(slots=True)
class RankReceivers:
    """Every rank's receiver, in rank order, and what decides whether a Start may use them."""

    receivers: list[CacheStoreReceiver]
    num_kv_heads: int  # the model's
    landed: set[str]  # the engine's LLMEngine.kv_landed: requests whose KV the ranks' pools hold already
    arrivals: list[int] = field(default_factory=list)  # requests whose shard each rank received whole (/health)

    def __post_init__(self) -> None:
        self.arrivals = [0] * len(self.receivers)

    def pairs_with(self, theirs: pb.Compat) -> bool:
        """Whether a prefill of ``theirs`` pushes per rank to us: it speaks our per-rank push, one of the two has
        several ranks (TP 1 to TP 1 is one shard of every head: the ordinary path), and every rank of ours holds
        exactly the heads of one rank of its."""
        size = theirs.tensor_parallel_size or 1
        return (theirs.kv_push == KV_PUSH_VERSION and max(size, len(self.receivers)) > 1
                and rank_sources(self.num_kv_heads, size, len(self.receivers)) is not None)

    def expect(self, request_id: str, blocks: Sequence[int], timeout_s: float) -> RankArrival:
        """Pin ``blocks`` on every rank's receiver (under ``rank_request_id``); the arrival to wait on and free."""
        arrival = RankArrival(self, request_id, [])
        try:
            for rank, receiver in enumerate(self.receivers):
                rid = rank_request_id(request_id, rank)
                dst = receiver.expect(rid, list(blocks), timeout_s)
                arrival.expected.append(rid)
                arrival.targets.append(pb.RankTarget(request_id=rid, cachestore_endpoint=receiver.endpoint,
                                                     kv_token=dst.token))
        except BaseException:
            arrival.delete()
            arrival.forget()
            raise
        self.landed.add(request_id)  # add_prefilled finds the KV in every rank's pool: no scatter
        return arrival

    def state(self) -> dict:
        """For /health: how many ranks receive, and the requests whose shard each rank received whole."""
        return {"ranks": len(self.receivers), "shards_received": list(self.arrivals)}


@dataclass(slots=True)
class RankArrival:
    """One request's entries on every rank's receiver."""

    ranks: RankReceivers
    request_id: str
    expected: list[str]  # the rank request ids pinned, in rank order
    targets: list[pb.RankTarget] = field(default_factory=list)  # for the Allocation

    def _pairs(self):
        return zip(self.ranks.receivers, self.expected)

    async def load(self, request_id: str, layer: int, timeout_s: float) -> None:
        """``layer`` arrived on every rank."""
        await _all([rx.load(rid, layer, timeout_s) for rx, rid in self._pairs()])

    async def wait_all(self, request_id: str, timeout_s: float) -> None:
        """Every block of every layer on every rank (the first failure raises: the session then deletes all)."""
        await _all([rx.wait_all(rid, timeout_s) for rx, rid in self._pairs()])
        for rank in range(len(self.expected)):
            self.ranks.arrivals[rank] += 1

    def delete(self, request_id: str | None = None) -> None:
        """Unpin every rank's entry (idempotent; the KV stays in the blocks for add_prefilled)."""
        for rx, rid in self._pairs():
            rx.delete(rid)

    def forget(self) -> None:
        """The session's end: the engine forgets the request's landing (add_prefilled took it, or never came)."""
        self.ranks.landed.discard(self.request_id)

    async def released(self, request_id: str, timeout_s: float) -> None:
        """No frame can land in the request's blocks on any rank any more."""
        await _all([rx.released(rid, timeout_s) for rx, rid in self._pairs()])


async def _all(waits: list) -> None:
    """Await every wait; the first failure (or our cancellation) cancels the rest and raises."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
