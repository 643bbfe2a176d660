"""KV tiers (engine/kv_tiers.py) under a BlockManager: blocks evicted from the pool go to host
memory then disk and come back bit-exactly; LRU per tier; budgets never exceeded; a corrupted
disk file is a miss; KV events say "removed" only when a hash leaves the last tier."""

import os
import random

import pytest
import torch

from pdserve.engine import BlockManager, KVCache, KVTiers, chained_hashes

BS = 4
LAYERS, HEADS, DIM = 2, 2, 8


class Listener:
    def __init__(self):
        self.live: set[int] = set()
        self.removed_log: list[int] = []

    def stored(self, hashes):
        assert not self.live & set(hashes), "stored twice without a removal"
        self.live.update(hashes)

    def removed(self, hashes):
        assert set(hashes) <= self.live, "removed a hash never stored"
        self.live.difference_update(hashes)
        self.removed_log += hashes

    def cleared(self):
        self.live.clear()


def _setup(tmp_path, num_blocks=4, host_blocks=2, disk_blocks=2):
    kv = KVCache(LAYERS, num_blocks, BS, HEADS, DIM)
    kv.tensor.copy_(torch.randn_like(kv.tensor))
    per_block = kv.block_nbytes * LAYERS
    tiers = KVTiers(kv, host_blocks * per_block, str(tmp_path) if disk_blocks else None, disk_blocks * per_block)
    bm = BlockManager(num_blocks, BS)
    bm.tiers, bm.listener = tiers, Listener()
    return kv, tiers, bm


def _fill(kv, bm, ids, seed):
    """Allocate, 'compute' (random KV, returned per token block), register, free: a finished request."""
    table, cached = bm.allocate(ids, len(ids))
    g = torch.Generator().manual_seed(seed)
    written = {}
    for i, b in enumerate(table):
        if i * BS >= cached:
            kv.tensor[:, b] = torch.randn(kv.tensor[:, b].shape, generator=g)
        written[i] = kv.tensor[:, b].clone()
    bm.register_full_blocks(table, [], len(ids), ids)
    bm.free(table)
    return written, cached


def _prompt(tag, blocks):
    return [tag * 1000 + t for t in range(blocks * BS)] + [7]  # + one token: every block is matchable


def test_round_trip_host_and_disk_bit_exact(tmp_path):
    kv, tiers, bm = _setup(tmp_path, num_blocks=4, host_blocks=2, disk_blocks=4)
    a = _prompt(1, 3)
    kv_a, _ = _fill(kv, bm, a, seed=1)
    _fill(kv, bm, _prompt(2, 3), seed=2)  # pushes a's blocks out of the pool into the host tier...
    _fill(kv, bm, _prompt(3, 3), seed=3)  # ...and on to disk
    stats = tiers.stats()
    assert stats["disk"].blocks > 0 and stats["host"].blocks > 0
    table, cached = bm.allocate(a, len(a))
    assert cached == 3 * BS  # every full block came back (pool, host or disk)
    for i in range(3):
        assert torch.equal(kv.tensor[:, table[i]], kv_a[i]), f"block {i} differs after the round trip"
    assert stats["disk"].hits + stats["host"].hits >= 1
    bm.free(table)


def test_disk_round_trip_from_each_tier_counts_hits(tmp_path):
    kv, tiers, bm = _setup(tmp_path, num_blocks=2, host_blocks=1, disk_blocks=8)
    prompts = [_prompt(p, 1) for p in range(1, 5)]
    written = [_fill(kv, bm, ids, seed=p)[0][0] for p, ids in enumerate(prompts)]
    # the pool keeps the newest hashed block, the host tier the one before, the disk the rest
    h0, h2 = chained_hashes(prompts[0][:BS], BS)[0], chained_hashes(prompts[2][:BS], BS)[0]
    assert h0 in tiers.disk and h2 in tiers.host
    for i in (2, 0):
        table, cached = bm.allocate(prompts[i], len(prompts[i]))
        assert cached == BS and torch.equal(kv.tensor[:, table[0]], written[i])
        bm.free(table)
    assert tiers.disk.stats.hits == 1 and tiers.host.stats.hits == 1
    assert tiers.disk.stats.bytes_out == tiers.block_bytes and tiers.disk.stats.seconds_out > 0


def test_lru_order_per_tier(tmp_path):
    kv, tiers, bm = _setup(tmp_path, num_blocks=2, host_blocks=2, disk_blocks=2)  # the pool keeps 1 hashed block
    prompts = [_prompt(p, 1) for p in range(1, 7)]
    hashes = [chained_hashes(p[:BS], BS)[0] for p in prompts]
    for p, ids in enumerate(prompts[:5]):
        _fill(kv, bm, ids, seed=p)
    # pool: 5; host: 3, 4 (oldest first); disk: 1, 2
    assert tiers.host.hashes() == hashes[2:4]
    assert tiers.disk.hashes() == hashes[0:2]
    _fill(kv, bm, prompts[0], seed=0)  # a hit from disk: 1 back in the pool, 5 to host, 3 down to disk
    assert hashes[0] not in tiers and tiers.host.hashes() == [hashes[3], hashes[4]]
    assert tiers.disk.hashes() == [hashes[1], hashes[2]]
    _fill(kv, bm, prompts[5], seed=5)
    assert tiers.host.hashes() == [hashes[4], hashes[0]]  # the newest arrival on top
    assert tiers.disk.hashes() == [hashes[2], hashes[3]]  # the oldest left the disk
    assert bm.listener.removed_log == [hashes[1]]
    assert len(os.listdir(tiers.disk.dir)) == 2


def test_budgets_never_exceeded_and_events_match_under_random_traffic(tmp_path):
    kv, tiers, bm = _setup(tmp_path, num_blocks=6, host_blocks=3, disk_blocks=5)
    rng = random.Random(5)
    for step in range(200):
        ids = _prompt(rng.randrange(12), rng.randrange(1, 4))
        table, _ = bm.allocate(ids, len(ids))
        bm.register_full_blocks(table, [], len(ids), ids)
        bm.free(table)
        for tier in tiers.tiers():
            assert tier.stats.bytes <= tier.budget, f"{tier.name} over budget at step {step}"
            assert tier.stats.bytes == tier.stats.blocks * tiers.block_bytes
        assert set(bm.prefix_hashes()) == bm.listener.live  # the events say what can be hit
        assert len(bm.prefix_hashes()) == len(set(bm.prefix_hashes()))  # exclusive: one place per hash
        assert len(os.listdir(tiers.disk.dir)) == tiers.disk.stats.blocks
    assert bm.num_free_blocks() == 6
    bm.clear_prefix_cache()
    assert tiers.hashes() == [] and os.listdir(tiers.disk.dir) == []
    tiers.close()
    assert not os.path.exists(tiers.disk.dir)


def test_corrupted_disk_file_is_a_miss_and_is_announced_removed(tmp_path):
    kv, tiers, bm = _setup(tmp_path, num_blocks=3, host_blocks=1, disk_blocks=4)
    a = _prompt(1, 2)
    _fill(kv, bm, a, seed=1)
    _fill(kv, bm, _prompt(2, 2), seed=2)
    _fill(kv, bm, _prompt(3, 2), seed=3)
    ha = chained_hashes(a[: 2 * BS], BS)
    assert ha[0] in tiers.disk
    with open(tiers.disk.path(ha[0]), "r+b") as f:  # flip one byte of the first block's file
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0xFF]))
    table, cached = bm.allocate(a, len(a))
    assert cached == 0  # the first block failed its checksum: nothing after it is reachable
    assert tiers.disk.stats.checksum_mismatches == 1 and ha[0] in bm.listener.removed_log
    assert ha[0] not in bm.prefix_hashes()
    bm.register_full_blocks(table, [], len(a), a)  # computed again: the pool copy replaces any tier copy
    assert ha[1] not in tiers and set(bm.prefix_hashes()) == bm.listener.live
    bm.free(table)


def test_bad_budgets_are_refused(tmp_path):
    kv = KVCache(LAYERS, 2, BS, HEADS, DIM)
    with pytest.raises(ValueError, match="at least one KV block"):
        KVTiers(kv, host_bytes=10)
    with pytest.raises(ValueError, match="needs both a directory and a byte budget"):
        KVTiers(kv, disk_dir=str(tmp_path))
    with pytest.raises(ValueError, match="needs both"):
        KVTiers(kv, disk_bytes=1 << 20)


def test_a_disk_write_that_fails_drops_the_block_and_the_engine_goes_on(tmp_path):
    kv, tiers, bm = _setup(tmp_path, num_blocks=2, host_blocks=1, disk_blocks=4)
    os.rmdir(tiers.disk.dir)  # every write fails from now on
    hashes = []
    for p in range(1, 5):
        ids = _prompt(p, 1)
        hashes.append(chained_hashes(ids[:BS], BS)[0])
        _fill(kv, bm, ids, seed=p)
    assert tiers.disk.stats.write_errors == 2 and tiers.disk.stats.blocks == 0
    assert bm.listener.removed_log == hashes[:2]  # announced gone, never matched again
    assert set(bm.prefix_hashes()) == bm.listener.live
    table, cached = bm.allocate(_prompt(1, 1), BS + 1)
    assert cached == 0
    bm.free(table)
