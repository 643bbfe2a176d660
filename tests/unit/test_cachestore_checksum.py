"""KV integrity checksums over real sockets in one process, both transports.

A byte is corrupted in flight by the sender's test hook (``CacheStoreSender(corrupt_kv=1)``, given when
the sender is built): the receiver must catch it before the layer counts as arrived, name the
layer, count it, and free everything; with checksums off the same hook shows the corruption
really reaches the destination (so the check is what catches it)."""

import asyncio

import pytest
import torch

from pdserve.cachestore import (CHECKSUM_MISMATCH, CacheStoreReceiver, CacheStoreSender, ChecksumError, CompatError,
                                CompatInfo, KVLayout, MemoryRegion, TransferError)

torch.set_num_threads(1)
L, NB, BS, H, D = 4, 32, 16, 2, 8
COMPAT = CompatInfo("float32", L, H, D, BS)
LAYOUT = KVLayout(L, NB, COMPAT.block_nbytes)
CORRUPT_LAYER = L // 2  # the layer the hook corrupts
SRC, DST = [3, 4, 5, 9, 0], [10, 11, 12, 2, 30]


class Pair:
    def __init__(self, transport: str, checksum: bool, require: bool = False, corrupt_kv: int = 0):
        self.src = torch.randn(L, NB, 2, BS, H, D)
        self.dst = torch.zeros(L, NB, 2, BS, H, D)
        fd, same_node = None, "off"
        if transport == "samenode":  # the receiver's pool in a memfd, mapped by the sender (cachestore/samenode.py)
            from pdserve.engine.kv_shared import shared_zeros

            self.dst, fd = shared_zeros(self.dst.shape, self.dst.dtype)
            transport, same_node = "tcp", "on"
        self.mismatches: list[tuple[str, int]] = []
        self.rx = CacheStoreReceiver(MemoryRegion.from_tensor(self.dst, shared_fd=fd), LAYOUT, COMPAT,
                                     transport=transport,
                                     require_checksum=require,
                                     on_checksum_mismatch=lambda rid, layer: self.mismatches.append((rid, layer)))
        self.tx = CacheStoreSender(MemoryRegion.from_tensor(self.src), LAYOUT, COMPAT, transport=transport,
                                   checksum=checksum, corrupt_kv=corrupt_kv, same_node=same_node)

    async def __aenter__(self):
        await self.rx.start()
        await self.tx.start()
        return self

    async def __aexit__(self, *exc):
        await self.tx.stop()
        await self.rx.stop()

    def send(self, rid: str, src=SRC, dst=DST) -> None:
        self.tx.bind(rid, self.rx.endpoint, self.rx.expect(rid, dst, 20))
        for layer in range(L):
            self.tx.store(rid, layer, src)

    def copied(self, layers=range(L), src=SRC, dst=DST) -> bool:
        return all(torch.equal(self.dst[l, d], self.src[l, s]) for l in layers for s, d in zip(src, dst))

    async def assert_clean(self):
        for _ in range(300):
            rs, ts = self.rx.stats(), self.tx.stats()
            if (rs["pinned_entries"] == rs["inflight_transfers"] == rs["pinned_blocks"] == rs["waiters"] == 0
                    and ts["pinned_entries"] == ts["inflight_transfers"] == ts["waiters"] == 0):
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"leaked: receiver {self.rx.stats()} sender {self.tx.stats()}")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


@pytest.mark.parametrize("transport", ["tcp", "nixl", "samenode"])
def test_a_byte_corrupted_in_flight_is_caught_and_named(transport):
    async def main():  # corrupt_kv=1: the first request sent gets one byte of layer CORRUPT_LAYER flipped
        async with Pair(transport, checksum=True, corrupt_kv=1) as p:
            p.send("bad")
            with pytest.raises(ChecksumError,
                               match=rf"{CHECKSUM_MISMATCH}: request 'bad' layer {CORRUPT_LAYER} ") as err:
                await p.rx.wait_all("bad", 20)
            assert err.value.layer == CORRUPT_LAYER and err.value.request_id == "bad"
            # the corrupted layer never counted as arrived: a wait for it gets the same error
            with pytest.raises(ChecksumError):
                await p.rx.load("bad", CORRUPT_LAYER, 5)
            assert p.mismatches == [("bad", CORRUPT_LAYER)]
            assert p.rx.stats()["checksum_mismatches"] == 1
            try:
                await p.tx.wait_sent("bad", 20)
                # nixl: a WRITE counts as delivered once NIXL reports it done, before the receiver
                # checked it; the receiver's failure is what stops the request there
                assert transport == "nixl", "tcp and samenode must never confirm a corrupted slice"
            except TransferError as exc:  # tcp always, nixl when the ERROR came first: a ChecksumError
                assert isinstance(exc, ChecksumError), exc
            p.rx.delete("bad"), p.tx.delete("bad")
            await p.rx.released("bad", 5)
            await p.assert_clean()

            # the link and the receiver keep working; the next request is checked and bit-exact
            verified = p.rx.stats()["frames_verified"]
            p.send("good")
            await p.rx.wait_all("good", 20)
            await p.tx.wait_sent("good", 20)
            assert p.copied()
            assert p.rx.stats()["frames_verified"] >= verified + L
            assert p.rx.stats()["checksum_mismatches"] == 1 and len(p.mismatches) == 1
            p.rx.delete("good"), p.tx.delete("good")
            await p.assert_clean()
    run(main())


@pytest.mark.parametrize("transport", ["tcp", "nixl", "samenode"])
def test_without_checksums_the_same_corruption_lands_unnoticed(transport):
    """The hook flips a byte of the data itself (not of the checksum): without checksums it arrives."""
    async def main():
        async with Pair(transport, checksum=False, corrupt_kv=1) as p:
            p.send("r")
            await p.rx.wait_all("r", 20)
            await p.tx.wait_sent("r", 20)
            others = [l for l in range(L) if l != CORRUPT_LAYER]
            assert p.copied(others) and not p.copied([CORRUPT_LAYER])
            got = p.dst[CORRUPT_LAYER, DST].contiguous().view(torch.uint8)
            want = p.src[CORRUPT_LAYER, SRC].contiguous().view(torch.uint8)
            assert torch.count_nonzero(got != want) == 1  # exactly one byte differs
            assert p.rx.stats()["frames_verified"] == 0 and p.mismatches == []
            p.rx.delete("r"), p.tx.delete("r")
            await p.assert_clean()
    run(main())


@pytest.mark.parametrize("transport", ["tcp", "nixl", "samenode"])
def test_receiver_requiring_checksums_refuses_a_sender_without(transport):
    async def main():
        async with Pair(transport, checksum=False, require=True) as p:
            p.send("r")
            with pytest.raises(CompatError, match="requires KV checksums"):
                await p.tx.wait_sent("r", 20)
            # the receiver counts the refusal right after sending it: the sender can be first
            for _ in range(200):
                if p.rx.stats()["connections_refused"]:
                    break
                await asyncio.sleep(0.01)
            assert p.rx.stats()["connections_refused"] == 1
            p.rx.delete("r"), p.tx.delete("r")
            await p.assert_clean()
    run(main())
