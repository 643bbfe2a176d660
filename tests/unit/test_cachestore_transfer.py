"""CacheStore over real sockets in one process, both transports: bit-exact data, subscriptions,
chunking over several connections, shared blocks, bursts. Every test ends with pinned entries and
in-flight transfers at 0 on both sides (failures and teardown: test_cachestore_failures.py)."""

import asyncio
import threading
import time

import pytest
import torch

from pdserve.cachestore import CacheStoreReceiver, CacheStoreSender, MemoryRegion

from harness.cachestore_pair import COMPAT, LAYOUT, NB, PAIR_TRANSPORTS, TRANSPORTS, L, Pair, pool, run
from harness.conditions import until


@pytest.mark.parametrize("transport", PAIR_TRANSPORTS)
def test_layerwise_bit_exact_with_subscriptions(transport):
    async def main():
        async with Pair(transport) as p:
            src_blocks, dst_blocks = [3, 4, 5, 9, 0], [10, 11, 12, 2, 30]
            for_sender = p.rx.expect("r1", dst_blocks, timeout_s=20)
            assert for_sender == dst_blocks
            p.tx.bind("r1", p.rx.endpoint, for_sender)
            # subscribe to every layer BEFORE anything is stored
            loads = [asyncio.create_task(p.rx.load("r1", l, 20)) for l in range(L)]
            await until(lambda: p.rx.stats()["waiters"] == L, "every layer's load to wait")
            assert not any(t.done() for t in loads)
            stored = threading.Event()

            def compute():  # the engine's compute thread: store right after each layer
                for l in range(L):
                    time.sleep(0.02)
                    p.tx.store("r1", l, src_blocks)
                stored.set()

            threading.Thread(target=compute).start()
            for l in range(L):
                await loads[l]
                assert p.copied(src_blocks, dst_blocks, [l]), f"layer {l} woke before its bytes landed"
            await p.rx.wait_all("r1", 20)
            await p.tx.wait_sent("r1", 20)
            assert stored.is_set() and p.copied(src_blocks, dst_blocks)
            untouched = [b for b in range(NB) if b not in dst_blocks]
            assert torch.count_nonzero(p.dst[:, untouched]) == 0
            p.rx.delete("r1"), p.tx.delete("r1")
            p.rx.delete("r1"), p.tx.delete("r1")  # idempotent
            await p.assert_clean()
    run(main())


@pytest.mark.parametrize("transport", PAIR_TRANSPORTS)
@pytest.mark.parametrize("scheduler", ["priority", "fifo"])
def test_many_requests_chunked_multi_connection(transport, scheduler):
    async def main():
        # chunks of 2 blocks so large transfers are split; 3 connections to the one receiver
        async with Pair(transport, scheduler=scheduler, chunk_bytes=2 * LAYOUT.block_nbytes,
                        connections_per_peer=3) as p:
            reqs = {f"r{i}": (list(range(i * 8, i * 8 + n)), list(range(NB - 1 - i * 8, NB - 1 - i * 8 - n, -1)))
                    for i, n in enumerate([8, 1, 5, 3])}
            for rid, (src, dst) in reqs.items():
                p.tx.bind(rid, p.rx.endpoint, p.rx.expect(rid, dst, 20))
            # store() from several "engine" threads at once, interleaved by layer
            def compute(rids):
                for l in range(L):
                    for rid in rids:
                        p.tx.store(rid, l, reqs[rid][0])

            threads = [threading.Thread(target=compute, args=(rids,)) for rids in (["r0", "r2"], ["r1"], ["r3"])]
            for t in threads:
                t.start()
            await asyncio.to_thread(lambda: [t.join() for t in threads])
            await asyncio.gather(*(p.rx.wait_all(r, 20) for r in reqs), *(p.tx.wait_sent(r, 20) for r in reqs))
            for rid, (src, dst) in reqs.items():
                assert p.copied(src, dst), rid
                p.rx.delete(rid), p.tx.delete(rid)
            await p.assert_clean()
    run(main())


@pytest.mark.parametrize("transport", PAIR_TRANSPORTS)
def test_identical_prompts_share_blocks_sent_once(transport):
    async def main():
        async with Pair(transport) as p:
            hashes = ["h0", "h1", "h2"]
            dst_a = p.rx.expect("a", [1, 2, 3], 20, block_hashes=hashes)
            dst_b = p.rx.expect("b", [1, 2, 7], 20, block_hashes=["h0", "h1", "other"])
            assert dst_a == [1, 2, 3] and dst_b == [-1, -1, 7]
            p.tx.bind("a", p.rx.endpoint, dst_a)
            p.tx.bind("b", p.rx.endpoint, dst_b)
            for l in range(L):
                p.tx.store("a", l, [4, 5, 6])
                p.tx.store("b", l, [4, 5, 8])
            await asyncio.gather(p.rx.wait_all("a", 20), p.rx.wait_all("b", 20),
                                 p.tx.wait_sent("a", 20), p.tx.wait_sent("b", 20))
            # 3 blocks for a + 1 for b per layer: shared blocks went over the wire once
            assert p.tx.stats()["bytes_sent"] == 4 * L * LAYOUT.block_nbytes
            p.rx.delete("a"), p.tx.delete("a")
            assert p.rx.stats()["pinned_blocks"] == 3  # b still pins 1, 2, 7
            await p.rx.wait_all("b", 1)
            assert p.copied([4, 5, 8], [1, 2, 7])
            p.rx.delete("b"), p.tx.delete("b")
            await p.assert_clean()
            assert p.rx.stats()["pinned_blocks"] == 0
    run(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_burst_to_two_receivers(transport):
    """One sender, two receivers, 48 requests in flight at once, stored from two threads."""
    async def main():
        src = pool(True)
        dsts = [pool(False), pool(False)]
        rxs = [CacheStoreReceiver(MemoryRegion.from_tensor(d), LAYOUT, COMPAT, transport=transport) for d in dsts]
        tx = CacheStoreSender(MemoryRegion.from_tensor(src), LAYOUT, COMPAT, transport=transport)
        for rx in rxs:
            await rx.start()
        await tx.start()
        try:
            reqs = {}
            for i in range(48):  # each receiver: 24 requests of one block (its own dst block)
                rx_i, slot = i % 2, i // 2
                reqs[f"b{i}"] = (rx_i, [i % NB], [slot])
                tx.bind(f"b{i}", rxs[rx_i].endpoint, rxs[rx_i].expect(f"b{i}", [slot], 60))

            def compute(names):
                for l in range(L):
                    for n in names:
                        tx.store(n, l, reqs[n][1])

            names = list(reqs)
            threads = [threading.Thread(target=compute, args=(names[k::2],)) for k in range(2)]
            for t in threads:
                t.start()
            await asyncio.to_thread(lambda: [t.join() for t in threads])
            await asyncio.gather(*(tx.wait_sent(n, 60) for n in reqs),
                                 *(rxs[r].wait_all(n, 60) for n, (r, _, _) in reqs.items()))
            for n, (r, s, d) in reqs.items():
                assert torch.equal(dsts[r][:, d[0]], src[:, s[0]]), n
                tx.delete(n), rxs[r].delete(n)
            assert tx.stats()["pinned_entries"] == 0
            assert all(rx.stats()["pinned_entries"] == 0 for rx in rxs)
        finally:
            await tx.stop()
            for rx in rxs:
                await rx.stop()
    run(main())



def test_nixl_layers_queued_together_go_as_one_write():
    """Layers queued while the nixl data thread waits go as ONE WRITE (up to NIXL_WRITE_BYTES), even
    when the scheduler cut each layer into several chunks; the bytes land bit-exact and each layer
    counts as delivered. (With a WRITE bounded by one layer of the pool this took L WRITEs.)"""
    async def main():
        async with Pair("nixl", chunk_bytes=8 * LAYOUT.block_nbytes) as p:  # 4 chunks per layer
            src_blocks, dst_blocks = list(range(NB)), list(range(NB - 1, -1, -1))
            dst = p.rx.expect("w", dst_blocks, timeout_s=20)
            p.tx.bind("w", p.rx.endpoint, dst)
            link = next(iter(p.tx._links.values()))
            posted = []
            agent = p.tx._transport.memory.agent
            real_transfer = agent.transfer

            def counting_transfer(handle, *a, **kw):
                posted.append(handle)
                return real_transfer(handle, *a, **kw)

            agent.transfer = counting_transfer
            with link.cond:  # the data thread cannot take a chunk until every layer is queued
                for layer in range(L):
                    p.tx.store("w", layer, src_blocks)
            await p.tx.wait_sent("w", 20)
            await p.rx.wait_all("w", 20)
            assert len(posted) == 1
            assert p.copied(src_blocks, dst_blocks)
            assert p.tx.stats()["bytes_sent"] == L * NB * LAYOUT.block_nbytes
            assert sorted(p.tx.layer_times("w")) == list(range(L))
            p.rx.delete("w"), p.tx.delete("w")
            await p.assert_clean()
    run(main())


@pytest.mark.parametrize("transport", PAIR_TRANSPORTS)
def test_a_layer_is_read_only_once_its_writer_is_done(transport):
    """A GPU engine stores a layer when its writes are only queued (KVCache.mark_written records an
    event): the sender takes the region's waiter for that layer at store() and the link's thread waits
    on it before it reads, so the bytes that arrive are the ones written after the store() call."""
    async def main():
        async with Pair(transport) as p:
            src_blocks, dst_blocks = [1, 2, 6], [7, 8, 9]
            final = torch.randn(L, len(src_blocks), *p.src.shape[2:])
            entered = [threading.Event() for _ in range(L)]
            written = [threading.Event() for _ in range(L)]
            captured_on: list[str] = []

            def layer_written(layer):  # MemoryRegion.layer_written: called by store(), on the storing thread
                captured_on.append(threading.current_thread().name)

                def wait():  # on the link's thread
                    entered[layer].set()
                    assert written[layer].wait(30), f"hang guard: layer {layer} never written"
                return wait

            p.tx.region.layer_written = layer_written
            p.tx.bind("g", p.rx.endpoint, p.rx.expect("g", dst_blocks, timeout_s=20))
            for layer in range(L):  # the engine ran ahead of its device: every layer stored, none written
                p.tx.store("g", layer, src_blocks)
            assert captured_on == [threading.current_thread().name] * L
            await until(entered[0].is_set, "the link to wait for layer 0's writes")
            assert len(p.tx.layer_times("g")) == 0, "a layer was delivered before its writes were done"
            for layer in range(L):  # the device catches up, layer by layer
                p.src[layer, src_blocks] = final[layer]
                written[layer].set()
            await p.tx.wait_sent("g", 20)
            await p.rx.wait_all("g", 20)
            assert all(torch.equal(p.dst[layer, d], final[layer, i]) for layer in range(L)
                       for i, d in enumerate(dst_blocks))
            p.rx.delete("g"), p.tx.delete("g")
            await p.assert_clean()
    run(main())
