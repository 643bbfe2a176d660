"""The per-rank push's pieces between tensor-parallel sizes, through real CacheStore senders and receivers in one
process (tcp and nixl): the prefill's RankSenders and the decode's RankReceivers as the servers build them, each
rank's pool a tensor holding its KV heads of a model's pool. Every pairing (P1, D2), (P2, D1), (P2, D2) on 2 KV
heads and on 1 KV head (replicated) lands in every decode rank's pool exactly its heads of the prefill's blocks:
a slice of a prefill rank's heads is packed contiguous and sent (pack on send, engine/tp/pieces.py), a decode
rank's heads from several prefill ranks land in staging pools and are unpacked (unpack on receive); checksums on;
each piece's receiver counts every block of every layer. After each, every entry on every end (ranks' and
slices') is free. A decode rank's receiver gone mid-request fails the request within the wait's bound on both
sides, with nothing pinned after."""

import asyncio
from dataclasses import replace

import pytest
import torch

from harness.cachestore_pair import TRANSPORTS, run
from harness.conditions import until
from pdserve.cachestore import CacheStoreReceiver, CacheStoreSender, CompatInfo, KVLayout, MemoryRegion, TransferError
from pdserve.decode_server.rank_receivers import RankReceivers
from pdserve.engine.tp.heads import kv_head_ranges
from pdserve.engine.tp.pieces import HeadSlice
from pdserve.prefill_server.rank_senders import RankSenders
from pdserve.protos import session_pb2 as pb
from pdserve.protos.version import KV_PUSH_VERSION

L, NB, BS, D = 3, 10, 4, 8
SRC, DST = [1, 2, 3, 7], [0, 5, 6, 4]  # prefill blocks -> decode blocks (runs and a gap)


def _compat(heads: range, model_heads: int) -> CompatInfo:
    return CompatInfo("float32", L, len(heads), D, BS, first_kv_head=heads.start, model_kv_heads=model_heads)


class Side:
    """One server's rank pools (each rank's heads of ``full``, or zeros) and how its ends are made."""

    def __init__(self, full: torch.Tensor, size: int, transport: str, fill: bool):
        self.heads = kv_head_ranges(full.shape[4], size)
        self.model_heads, self.transport = full.shape[4], transport
        parts = [full[..., h.start:h.stop, :] for h in self.heads]
        self.pools = [p.clone(memory_format=torch.contiguous_format) if fill else torch.zeros(p.shape) for p in parts]

    def ends(self, tensor: torch.Tensor, heads: range):
        compat = _compat(heads, self.model_heads)
        return MemoryRegion.from_tensor(tensor), KVLayout(L, NB, compat.block_nbytes), compat

    async def sender(self, tensor: torch.Tensor, heads: range) -> CacheStoreSender:
        tx = CacheStoreSender(*self.ends(tensor, heads), transport=self.transport, checksum=True)
        await tx.start()
        return tx

    async def receiver(self, tensor: torch.Tensor, heads: range) -> CacheStoreReceiver:
        rx = CacheStoreReceiver(*self.ends(tensor, heads), transport=self.transport, require_checksum=True)
        await rx.start()
        return rx


async def _servers(full: torch.Tensor, p: int, d: int, transport: str) -> tuple[RankSenders, RankReceivers, Side]:
    prefill, decode = Side(full, p, transport, True), Side(full, d, transport, False)

    async def tx_slice(rank: int, heads: range):
        staged = HeadSlice(prefill.pools[rank], prefill.heads[rank], heads)
        return staged, await prefill.sender(staged.tensor, heads)

    async def rx_slice(rank: int, heads: range):
        staged = HeadSlice(decode.pools[rank], decode.heads[rank], heads)
        return staged, await decode.receiver(staged.tensor, heads)

    senders = [await prefill.sender(t, h) for t, h in zip(prefill.pools, prefill.heads)]
    receivers = [await decode.receiver(t, h) for t, h in zip(decode.pools, decode.heads)]
    return (RankSenders(senders, full.shape[4], tx_slice), RankReceivers(receivers, full.shape[4], set(), rx_slice),
            decode)


def _store(parts, layer: int) -> None:
    """What the prefill's layer callback does (prefill_server/decode_session.py): pack a slice, then store."""
    for part in parts:
        if part.pack is not None:
            part.pack(layer, SRC)
        part.sender.store(part.request_id, layer, SRC, 0)


async def _stop(tx: RankSenders, rx: RankReceivers, stopped=()) -> None:
    for end in [*tx.all_senders, *rx.all_receivers]:
        if end not in stopped:
            await end.stop()


async def _nothing_pinned(tx: RankSenders, rx: RankReceivers) -> None:
    ends = [*tx.all_senders, *rx.all_receivers]
    await until(lambda: all(e.stats()["pinned_entries"] == 0 and e.stats()["inflight_transfers"] == 0 for e in ends),
                "every rank's and slice's CacheStore entry released")


async def _push(tx: RankSenders, rx: RankReceivers, rid: str, p: int, heads: int):
    """One request: the decode's plan and expect, the prefill's parts bound, every layer stored."""
    pieces = rx.plan(pb.Compat(num_kv_heads=heads, tensor_parallel_size=p, kv_push=KV_PUSH_VERSION))
    assert pieces is not None
    arrival = await rx.expect(rid, DST, 20, pieces)
    parts = await tx.parts(pb.Allocation(block_ids=DST, rank_targets=arrival.targets))
    for part, target in zip(parts, arrival.targets):
        part.sender.bind(part.request_id, part.endpoint, part.dst, target.kv_token)
    return arrival, parts


@pytest.mark.parametrize("heads, p, d", [(2, 1, 2), (2, 2, 1), (2, 2, 2), (1, 1, 2), (1, 2, 1)])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_decode_rank_gets_exactly_its_heads_from_the_prefill_ranks(transport, heads, p, d):
    full = torch.randn(L, NB, 2, BS, heads, D)

    async def main():
        tx, rx, decode = await _servers(full, p, d, transport)
        try:
            arrival, parts = await _push(tx, rx, "r", p, heads)
            for layer in range(L):
                _store(parts, layer)
            await arrival.wait_all("r", 20)
            for part in parts:
                await part.sender.wait_sent(part.request_id, 20)
            for rank, h in enumerate(decode.heads):
                want = full[:, SRC][..., h.start:h.stop, :]
                assert torch.equal(decode.pools[rank][:, DST], want), f"decode rank {rank}"
                assert not decode.pools[rank][:, [b for b in range(NB) if b not in DST]].any()  # nothing else written
            sliced = sum(part.pack is not None for part in parts)
            assert sliced == (d if heads == 2 and p < d else 0)  # TP 1 into TP 2 on 2 heads: each piece a slice
            assert rx.unpacked == (p if heads == 2 and p > d else 0)  # TP 2 into TP 1: both pieces unpacked
            assert rx.arrivals == [1] * d
            received = [e.stats() for e in rx.all_receivers]
            head_bytes = 2 * BS * D * 4  # one KV head of one block of one layer, K and V, float32
            # exactly the heads each decode rank holds, each block of each layer once: no whole blocks, no repeats
            assert sum(s["bytes_received"] for s in received) == L * len(DST) * head_bytes * sum(map(len, decode.heads))
            assert sum(s["frames_verified"] for s in received) > 0
            assert sum(s["checksum_mismatches"] for s in received) == 0
            arrival.delete()
            arrival.forget()
            for part in parts:
                part.sender.delete(part.request_id)
            await _nothing_pinned(tx, rx)
            assert rx.landed == set()
        finally:
            await _stop(tx, rx)

    run(main())


def test_a_decode_ranks_receiver_gone_fails_the_request_within_the_bound_and_frees_everything():
    """(P1, D2) on 2 KV heads, tcp: decode rank 1's receiver stops before the KV comes. Its piece's sender fails
    (the receiver's connection closed), the arrival's wait raises (its entry failed with the receiver), both
    within the wait's bound; once the session deletes, nothing is pinned on any end."""
    full = torch.randn(L, NB, 2, BS, 2, D)

    async def main():
        tx, rx, _ = await _servers(full, 1, 2, "tcp")
        gone = rx.receivers[1]
        try:
            arrival, parts = await _push(tx, rx, "gone", 1, 2)
            await gone.stop()
            for layer in range(L):
                _store(parts, layer)
            began = asyncio.get_running_loop().time()
            with pytest.raises((TransferError, LookupError), match="gone"):  # failed at the stop, or unknown since
                await arrival.wait_all("gone", 10)
            with pytest.raises(TransferError):
                for part in parts:
                    await part.sender.wait_sent(part.request_id, 10)
            assert asyncio.get_running_loop().time() - began < 10
            arrival.delete()
            arrival.forget()
            await arrival.released("gone", 5)
            for part in parts:
                part.sender.delete(part.request_id)
            await _nothing_pinned(tx, rx)
        finally:
            await _stop(tx, rx, stopped=[gone])

    run(main())


def test_a_prefill_asked_for_heads_its_rank_does_not_hold_refuses_naming_them():
    full = torch.randn(L, NB, 2, BS, 2, D)

    async def main():
        tx, rx, _ = await _servers(full, 2, 2, "tcp")
        try:
            bad = pb.RankTarget(request_id="x/rank0", prefill_rank=0, first_kv_head=1, num_kv_heads=1)
            with pytest.raises(ValueError, match="KV heads 1..1 from our rank 0, which does not hold them"):
                await tx.parts(pb.Allocation(block_ids=DST, rank_targets=[bad]))
            with pytest.raises(ValueError, match="does not hold them"):
                await tx.parts(pb.Allocation(block_ids=DST, rank_targets=[replace_rank(bad, 2)]))
        finally:
            await _stop(tx, rx)

    run(main())


def replace_rank(target: pb.RankTarget, rank: int) -> pb.RankTarget:
    out = pb.RankTarget()
    out.CopyFrom(target)
    out.prefill_rank = rank
    return out


def test_head_slice_packs_and_unpacks_only_its_heads_of_the_given_blocks():
    pool = torch.randn(L, NB, 2, BS, 4, D)
    staged = HeadSlice(pool, range(4, 8), range(6, 8))
    staged.tensor.zero_()
    staged.pack(1, SRC)
    assert torch.equal(staged.tensor[1, SRC], pool[1, SRC][..., 2:4, :])
    assert not staged.tensor[0].any() and not staged.tensor[1, [0, 4]].any()
    staged.tensor.copy_(torch.randn_like(staged.tensor))
    before = pool.clone()
    staged.unpack(DST)
    assert torch.equal(pool[:, DST][..., 2:4, :], staged.tensor[:, DST])
    assert torch.equal(pool[..., :2, :], before[..., :2, :])  # the rank's other heads untouched
    others = [b for b in range(NB) if b not in DST]
    assert torch.equal(pool[:, others], before[:, others])
    with pytest.raises(ValueError, match="not a part of the rank's"):
        HeadSlice(pool, range(4, 8), range(4, 8))
    with pytest.raises(ValueError, match="not a part of the rank's"):
        HeadSlice(pool, range(4, 8), range(2, 5))


def test_compat_of_a_slice_equals_a_rank_holding_exactly_those_heads():
    """A packed slice binds to a decode rank of those heads, never to another rank's (the hash names the range)."""
    slice_heads = _compat(range(1, 2), 2)
    assert slice_heads.compat_hash == replace(_compat(range(0, 2), 2), num_kv_heads=1, first_kv_head=1).compat_hash
    assert slice_heads.compat_hash != _compat(range(0, 1), 2).compat_hash
