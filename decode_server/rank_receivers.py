"""The decode's per-rank push: one CacheStore receiver per tensor-parallel rank, each on that rank's pool, and one
per head slice of a rank that several prefill ranks fill.

With ``--kv-push per-rank`` (the default) a decode offers each prefill that speaks a per-rank push we know
(``Start.compat.kv_push``, ``protos/version.py`` KV_PUSH_VERSION) and whose KV heads nest with ours
(``engine/tp/heads.py`` rank_pieces) an ``Allocation`` with one ``RankTarget`` per *piece*: KV heads of one rank of
ours from one prefill rank, under the request id ``<rid>/rank<r>`` (the rank's whole shard) or
``<rid>/rank<r>/heads<a>-<b>`` (part of it), with that receiver's endpoint and bind token and the prefill rank and
heads it takes:

- a piece that is our rank's whole shard lands straight in its pool, on the rank's receiver (its own port, or
  NIXL agent; its compat names the rank's KV heads), whether the prefill sends its own whole shard (equal
  sizes, replicated heads) or a slice of it packed contiguous (2 KV heads from TP 1 into TP 2);
- a piece that is part of our rank's heads (TP 2 into TP 1: each prefill rank holds one of our rank's heads)
  lands in the staging pool of those heads (``engine/tp/pieces.py`` HeadSlice, made with its own receiver at the
  first request that needs it), and is unpacked into the rank's pool once every piece of the request arrived.

Every piece's receiver counts every block of every layer, checksum per slice (so per piece: from the prefill
rank's pool or slice to our rank's pool or slice); the request is admitted to the batch only when every piece is
complete (``wait_all``) and unpacked, with no scatter from rank 0 (``LLMEngine.kv_landed``). A version-1 prefill
is offered only whole-shard pairings; otherwise (an older prefill, ``--kv-push gather`` on either end, heads that
need slices where either side's pools are not on the CPU) the session uses the one receiver on rank 0's
transfer pool, as before.

A TP 1 decode has one rank: its receiver is the ordinary one (its pool holds every head). Between two TP 1
servers it is never offered (one shard of every head: the ordinary path, unchanged).

``RankArrival`` is what one session holds: the pieces it expected, and the waits and clean-up over all of them
(the same calls the session makes on a single receiver: ``load``, ``wait_all``, ``delete``, ``released``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, Callable, Sequence

from pdserve.engine.tp.heads import Piece, rank_pieces
from pdserve.protos import session_pb2 as pb
from pdserve.protos.version import KV_PUSH_VERSION

if TYPE_CHECKING:
    from pdserve.cachestore import CacheStoreReceiver
    from pdserve.engine.tp.pieces import HeadSlice

# (our rank, the heads) -> the slice's staging pool and its started receiver (wiring.start_rank_receivers)
MakeSlice = Callable[[int, range], Awaitable[tuple["HeadSlice", "CacheStoreReceiver"]]]


def rank_request_id(request_id: str, rank: int, heads: range | None = None) -> str:
    """The id a rank's receiver (or, with ``heads``, the receiver of that slice of the rank) expects a piece
    under (the prefill binds it from the RankTarget)."""
    rid = f"{request_id}/rank{rank}"
    return rid if heads is None else f"{rid}/heads{heads.start}-{heads.stop - 1}"


@dataclass(slots=True)
class RankReceivers:
    """Every rank's receiver, in rank order, the head slices' receivers made so far, and what decides whether a
    Start may use them (``version``: the per-rank push we speak; ``make_slice`` None: no slices, e.g. a GPU)."""

    receivers: list[CacheStoreReceiver]
    num_kv_heads: int  # the model's
    landed: set[str]  # the engine's LLMEngine.kv_landed: requests whose KV the ranks' pools hold already
    make_slice: MakeSlice | None = None
    version: int = KV_PUSH_VERSION
    slices: dict[tuple[int, int, int], tuple[HeadSlice, CacheStoreReceiver]] = field(default_factory=dict)
    arrivals: list[int] = field(default_factory=list)  # requests whose pieces each rank received whole (/health)
    unpacked: int = 0  # pieces unpacked from a slice's staging pool into a rank's pool
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        self.arrivals = [0] * len(self.receivers)

    @property
    def all_receivers(self) -> list[CacheStoreReceiver]:
        """The ranks' receivers and the slices' (for stats and stop)."""
        return self.receivers + [receiver for _, receiver in self.slices.values()]

    def plan(self, theirs: pb.Compat) -> list[Piece] | None:
        """The pieces a prefill of ``theirs`` pushes to us, or None when it does not push per rank to us: it speaks
        no per-rank push we know, both are TP 1 (one shard of every head: the ordinary path), the heads do not
        nest, or a piece needs a slice that it (version 1) or we (no ``make_slice``) cannot make."""
        size = theirs.tensor_parallel_size or 1
        if not 1 <= theirs.kv_push <= KV_PUSH_VERSION or max(size, len(self.receivers)) <= 1:
            return None
        pieces = rank_pieces(self.num_kv_heads, size, len(self.receivers))
        if pieces is None or all(p.whole_source and p.whole_dest for p in pieces):
            return pieces
        if theirs.kv_push < 2 or self.version < 2:
            return None
        return pieces if self.make_slice is not None or all(p.whole_dest for p in pieces) else None

    def pairs_with(self, theirs: pb.Compat) -> bool:
        return self.plan(theirs) is not None

    async def expect(self, request_id: str, blocks: Sequence[int], timeout_s: float,
                     pieces: list[Piece]) -> RankArrival:
        """Pin ``blocks`` for every piece on its receiver (a slice's made first, at its first use); the arrival to
        wait on and free."""
        staged = {p: await self._slice(p.decode_rank, p.heads) for p in pieces if not p.whole_dest}
        arrival = RankArrival(self, request_id, [], list(blocks))
        try:
            for piece in pieces:
                rank, heads = piece.decode_rank, piece.heads
                slot = staged.get(piece)
                rx = self.receivers[rank] if slot is None else slot[1]
                rid = rank_request_id(request_id, rank, None if slot is None else heads)
                dst = rx.expect(rid, list(blocks), timeout_s)
                arrival.expected.append((rx, rid, rank, None if slot is None else slot[0]))
                arrival.targets.append(pb.RankTarget(request_id=rid, cachestore_endpoint=rx.endpoint,
                                                     kv_token=dst.token, prefill_rank=piece.prefill_rank,
                                                     first_kv_head=heads.start, num_kv_heads=len(heads)))
        except BaseException:
            arrival.delete()
            arrival.forget()
            raise
        self.landed.add(request_id)  # add_prefilled finds the KV in every rank's pool: no scatter
        return arrival

    async def _slice(self, rank: int, heads: range) -> tuple[HeadSlice, CacheStoreReceiver]:
        """The staging pool and receiver of heads ``heads`` of our rank ``rank``, made at first use."""
        key = (rank, heads.start, heads.stop)
        async with self._lock:
            if key not in self.slices:
                assert self.make_slice is not None  # plan() offers slices only with it
                self.slices[key] = await self.make_slice(rank, heads)
            return self.slices[key]

    def state(self) -> dict:
        """For /health: how many ranks receive, the requests whose pieces each rank received whole, the slices."""
        return {"ranks": len(self.receivers), "shards_received": list(self.arrivals), "slices": len(self.slices),
                "unpacked": self.unpacked, "bytes_received": [rx.stats()["bytes_received"] for rx in self.receivers],
                "slice_bytes_received": sum(rx.stats()["bytes_received"] for _, rx in self.slices.values())}


@dataclass(slots=True)
class RankArrival:
    """One request's entries on every piece's receiver."""

    ranks: RankReceivers
    request_id: str
    expected: list[tuple]  # (receiver, request id, our rank, the slice's staging pool or None), in piece order
    blocks: list[int]
    targets: list[pb.RankTarget] = field(default_factory=list)  # for the Allocation

    async def load(self, request_id: str, layer: int, timeout_s: float) -> None:
        """``layer`` arrived on every piece's receiver."""
        await _all([rx.load(rid, layer, timeout_s) for rx, rid, _, _ in self.expected])

    async def wait_all(self, request_id: str, timeout_s: float) -> None:
        """Every block of every layer of every piece, the slices unpacked into their ranks' pools (the first
        failure raises: the session then deletes all). The unpack runs here, on the loop, before the request can
        join the batch: a copy of the request's blocks of those heads."""
        await _all([rx.wait_all(rid, timeout_s) for rx, rid, _, _ in self.expected])
        for _, _, _, staged in self.expected:
            if staged is not None:
                staged.unpack(self.blocks)
                self.ranks.unpacked += 1
        for rank in sorted({rank for _, _, rank, _ in self.expected}):
            self.ranks.arrivals[rank] += 1

    def delete(self, request_id: str | None = None) -> None:
        """Unpin every piece's entry (idempotent; the KV stays in the blocks for add_prefilled)."""
        for rx, rid, _, _ in self.expected:
            rx.delete(rid)

    def forget(self) -> None:
        """The session's end: the engine forgets the request's landing (add_prefilled took it, or never came)."""
        self.ranks.landed.discard(self.request_id)

    async def released(self, request_id: str, timeout_s: float) -> None:
        """No frame can land in the request's blocks (or slices) on any rank any more."""
        await _all([rx.released(rid, timeout_s) for rx, rid, _, _ in self.expected])


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
