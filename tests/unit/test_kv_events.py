"""KV events at the source: the BlockManager tells its listener every change of its hash set,
and the KvEventPublisher numbers them, mirrors the set and fans them out to subscribers."""

import asyncio
import random
import threading

from pdserve.engine import BlockManager, OutOfBlocksError
from pdserve.kv_events import CLEARED, REMOVED, STORED, KvEventPublisher


class Mirror:
    def __init__(self):
        self.hashes, self.events = set(), []

    def stored(self, hashes):
        assert not set(hashes) & self.hashes, "a hash was stored twice"
        self.hashes.update(hashes)
        self.events.append(("stored", list(hashes)))

    def removed(self, hashes):
        assert set(hashes) <= self.hashes, "a hash was removed that was never stored"
        self.hashes.difference_update(hashes)
        self.events.append(("removed", list(hashes)))

    def cleared(self):
        self.hashes.clear()
        self.events.append(("cleared", []))


def test_listener_mirrors_the_prefix_cache_through_random_traffic():
    bs, rng = 4, random.Random(11)
    bm = BlockManager(24, bs)
    bm.listener = mirror = Mirror()
    prefixes = [[rng.randrange(9) for _ in range(bs * 3)] for _ in range(4)]
    held = []
    for step in range(600):
        if held and rng.random() < 0.45:
            table, hashes, ids = held.pop(rng.randrange(len(held)))
            bm.free(table)
        elif step % 97 == 96:
            bm.clear_prefix_cache()
        else:
            ids = (rng.choice(prefixes)[: rng.randrange(1, bs * 3)]
                   + [rng.randrange(9) for _ in range(rng.randrange(0, 9))])
            try:
                table, cached = bm.allocate(ids, len(ids))
            except OutOfBlocksError:
                continue
            hashes = []
            bm.register_full_blocks(table, hashes, len(ids), ids)
            held.append((table, hashes, ids))
        assert mirror.hashes == set(bm.prefix_hashes()), f"step {step}"
    kinds = {k for k, _ in mirror.events}
    assert kinds == {"stored", "removed", "cleared"}
    for table, _, _ in held:
        bm.free(table)
    assert bm.num_free_blocks() == 24


def test_publisher_numbers_events_and_snapshots_consistently():
    async def main():
        pub = KvEventPublisher(block_size=4, epoch="ep")
        pub.stored([1, 2])
        sub = pub.subscribe()
        assert (sub.snapshot_seq, sub.snapshot) == (1, [1, 2])
        t = threading.Thread(target=lambda: (pub.stored([3]), pub.removed([1]), pub.cleared()))  # the "engine thread"
        t.start()
        t.join()
        got = []
        while len(got) < 3:
            got += await pub.next_events(sub)
        assert got == [(2, STORED, (3,)), (3, REMOVED, (1,)), (4, CLEARED, ())]
        assert pub.snapshot() == (4, [])
        pub.unsubscribe(sub)
        assert pub.num_subscribers() == 0
        msg = pub.snapshot_message(*pub.snapshot())
        assert msg.epoch == "ep" and msg.block_size == 4 and msg.version >= 1

    asyncio.run(main())


def test_a_slow_subscriber_gets_a_gap_not_a_wrong_set():
    async def main():
        pub = KvEventPublisher(block_size=4, max_pending=2)
        sub = pub.subscribe()
        for h in range(5):  # nothing is taken meanwhile: only 2 fit
            pub.stored([h])
        assert sub.dropped == 3
        assert [e[0] for e in await pub.next_events(sub)] == [1, 2]
        pub.stored([9])
        assert [e[0] for e in await pub.next_events(sub)] == [6]  # 3..5 are missing: the gap
        assert pub.snapshot() == (6, [0, 1, 2, 3, 4, 9])

    asyncio.run(main())
