"""The router's index at a prefill's real size: a snapshot of more blocks than gRPC's 4 MiB default
message holds reaches the index (issue 50: 625k blocks per prefill were refused, the prefill never synced),
and the prompt hashes packed once are the engine's block hashes."""

import asyncio
import random
import struct

import grpc

from pdserve.engine.block_manager import block_hash, chained_hashes, reusable_blocks, reusable_hashes
from pdserve.kv_events import KvEventPublisher, KvEventsServicer
from pdserve.kv_index import PrefixIndex
from pdserve.net import free_port
from pdserve.protos import kv_events_pb2 as kpb
from pdserve.protos import kv_events_pb2_grpc as kpb_grpc
from pdserve.router.prefill_watch import PrefillWatch
from harness.conditions import until

BIG = 500_000  # ~5 MB as a snapshot message: over gRPC's default 4 MiB


def test_a_snapshot_over_four_mib_reaches_the_router_index():
    async def main():
        pub = KvEventPublisher(block_size=64, epoch="e")
        rng = random.Random(0)
        hashes = [rng.getrandbits(64) - 2**63 for _ in range(BIG)]
        pub.stored(hashes)
        server = grpc.aio.server()
        kpb_grpc.add_KvEventsServicer_to_server(KvEventsServicer(pub, lambda: kpb.ServerLoad(ready=True)), server)
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        index = PrefixIndex()
        address = f"127.0.0.1:{port}"
        watch = PrefillWatch(address, index)
        await watch.start()
        try:
            view = await until(lambda: (v := index.view(address)) is not None and v.synced and v, "the snapshot")
            assert len(view.hashes) == BIG
            assert index.overlap(address, hashes[:3] + [12345]) == 3
            pub.removed([hashes[1]])
            await until(lambda: index.view(address).seq == 2, "the event after the snapshot")
            assert index.overlap(address, hashes[:3]) == 1
        finally:
            await watch.stop()
            await server.stop(None)
        # the servicer's stream handler unsubscribes in its own finally, after the server's stop returns
        await until(lambda: pub.num_subscribers() == 0, "the subscription released")

    asyncio.run(main())


def _one_by_one(ids, block_size, parent=None):
    out = []
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = block_hash(parent, ids[start:start + block_size])
        out.append(parent)
    return out


def test_chained_hashes_are_block_hash_chained():
    rng = random.Random(1)
    for _ in range(200):
        n, bs = rng.randrange(0, 300), rng.choice([1, 3, 16, 64])
        ids = [rng.randrange(-2**40, 2**40) for _ in range(n)]
        parent = rng.choice([None, rng.getrandbits(63)])
        assert chained_hashes(ids, bs, parent) == _one_by_one(ids, bs, parent)
    ids = list(range(1000))
    assert len(reusable_hashes(ids, 64)) == reusable_blocks(len(ids), 64) == 15
    # the bytes hashed are the parent then the block's ids, little-endian int64 (what every process computes)
    assert chained_hashes([7, 8], 2) == [block_hash(None, (7, 8))]
    assert struct.calcsize("<q") == 8


def test_an_allocation_publishes_its_evictions_in_one_event():
    from pdserve.engine.block_manager import BlockManager

    class Listener:
        def __init__(self):
            self.events = []

        def stored(self, hashes):
            self.events.append(("stored", list(hashes)))

        def removed(self, hashes):
            self.events.append(("removed", list(hashes)))

        def cleared(self):
            self.events.append(("cleared", []))

    bm = BlockManager(num_blocks=6, block_size=4)
    bm.listener = Listener()
    ids = list(range(17))  # 4 full blocks + 1
    table, _ = bm.allocate(ids, len(ids))
    hashes: list[int] = []
    bm.register_full_blocks(table, hashes, len(ids), ids)
    bm.free(table)
    other = [99] * 21  # 6 blocks: 1 free + 4 cached of `ids` (and the tail block freed without a hash)
    table2, cached = bm.allocate(other, len(other))
    assert cached == 0 and len(table2) == 6
    removals = [e for e in bm.listener.events if e[0] == "removed"]
    assert removals == [("removed", hashes[::-1])]  # one event, the prefix's tail evicted first
    assert bm.prefix_hashes() == []


def test_lazy_hashes_are_the_reusable_hashes_and_only_as_many_as_a_lookup_reads():
    from pdserve.engine.block_manager import LazyReusableHashes

    rng = random.Random(3)
    for n, bs in ((0, 16), (1, 16), (16, 16), (17, 16), (33, 16), (1000, 64), (12035, 64), (5, 1)):
        ids = [rng.randrange(1 << 40) for _ in range(n)]
        lazy = LazyReusableHashes(ids, bs)
        assert list(lazy) == reusable_hashes(ids, bs) and len(lazy) == reusable_blocks(n, bs), (n, bs)
        assert list(lazy) == reusable_hashes(ids, bs)  # read again: the same, from what was computed
    ids = [rng.randrange(1 << 40) for _ in range(64 * 40 + 1)]
    full = reusable_hashes(ids, 64)
    index = PrefixIndex()
    index.apply_snapshot("a", "e", 0, full[:3], 64)
    index.apply_snapshot("b", "e", 0, full[:7], 64)
    lazy = LazyReusableHashes(ids, 64)
    assert [index.overlap(s, lazy) for s in ("a", "b", "c")] == [3, 7, 0]
    assert lazy.computed == 8  # the longest match (7) + the block that missed, not all 40
