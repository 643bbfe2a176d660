"""A CacheStore receiver and sender on loopback in one process, with their own small pools
(``Pair``), for the in-process CacheStore tests."""

import asyncio

import torch

from pdserve.cachestore import CacheStoreReceiver, CacheStoreSender, CompatInfo, KVLayout, MemoryRegion

torch.set_num_threads(1)
L, NB, BS, H, D = 4, 32, 16, 2, 8
COMPAT = CompatInfo("float32", L, H, D, BS)
LAYOUT = KVLayout(L, NB, COMPAT.block_nbytes)
TRANSPORTS = ["tcp", "nixl"]
# Pair's also: "samenode", a tcp receiver whose pool is in a memfd (offered) and a sender that must map it
# (same_node="on"; cachestore/samenode.py)
PAIR_TRANSPORTS = [*TRANSPORTS, "samenode"]
NO_TOKEN = bytes(16)  # a bind token no receiver issued (for binds the receiver refuses anyway, or never sees)


def pool(random: bool) -> torch.Tensor:
    shape = (L, NB, 2, BS, H, D)
    return torch.randn(shape) if random else torch.zeros(shape)


class Pair:
    """A receiver and a sender on loopback with their own pools."""

    def __init__(self, transport: str, **tx_kw):
        self.src, self.dst = pool(True), pool(False)
        fd = None
        if transport == "samenode":
            from pdserve.engine.kv_shared import shared_zeros

            self.dst, fd = shared_zeros(self.dst.shape, self.dst.dtype)
            transport, tx_kw = "tcp", {"same_node": "on", **tx_kw}
        self.rx = CacheStoreReceiver(MemoryRegion.from_tensor(self.dst, shared_fd=fd), LAYOUT, COMPAT,
                                     transport=transport)
        self.tx = CacheStoreSender(MemoryRegion.from_tensor(self.src), LAYOUT, COMPAT, transport=transport, **tx_kw)

    async def __aenter__(self):
        await self.rx.start()
        await self.tx.start()
        return self

    async def __aexit__(self, *exc):
        await self.tx.stop()
        await self.rx.stop()

    def copied(self, src_blocks, dst_blocks, layers=range(L)) -> bool:
        return all(torch.equal(self.dst[l, d], self.src[l, s]) for l in layers for s, d in zip(src_blocks, dst_blocks))

    async def assert_clean(self):
        for _ in range(200):  # frees on the other side travel over the wire
            rs, ts = self.rx.stats(), self.tx.stats()
            if (rs["pinned_entries"] == rs["inflight_transfers"] == ts["pinned_entries"]
                    == ts["inflight_transfers"] == 0):
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"leaked: receiver {self.rx.stats()} sender {self.tx.stats()}")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))
