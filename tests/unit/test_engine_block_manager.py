"""BlockManager (pure Python): ref counts, chained hashes, prefix reuse, LRU eviction, all-or-nothing."""

import pytest

from pdserve.engine import BlockManager, OutOfBlocksError, block_hash, chained_hashes

BS = 4


def test_chained_hash_covers_parent():
    a = chained_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS)
    b = chained_hashes([9, 2, 3, 4, 5, 6, 7, 8], BS)
    assert len(a) == 2 and len(chained_hashes([1, 2, 3, 4, 5], BS)) == 1  # partial block: no hash
    assert a[1] != b[1]  # same second block, different first -> different hash
    assert a[1] == block_hash(a[0], [5, 6, 7, 8])
    assert a == chained_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS)  # deterministic


def test_allocate_and_free_restores_all_blocks():
    bm = BlockManager(8, BS)
    t1, cached = bm.allocate(list(range(10)), 10)
    assert cached == 0 and len(t1) == 3 and bm.num_free_blocks() == 5
    t2, _ = bm.allocate([7] * 3, 3)
    assert not set(t1) & set(t2)
    bm.append_slots(t2, 9)
    assert len(t2) == 3 and bm.num_free_blocks() == 2
    bm.free(t1)
    bm.free(t2)
    assert bm.num_free_blocks() == 8
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free(t2)


def test_out_of_blocks_changes_nothing():
    bm = BlockManager(4, BS)
    held, _ = bm.allocate([1] * 8, 8)
    with pytest.raises(OutOfBlocksError, match="need 3 free KV blocks .* only 2 are free"):
        bm.allocate([2] * 12, 12)
    assert bm.num_free_blocks() == 2
    with pytest.raises(OutOfBlocksError):
        bm.append_slots(held, 20)
    assert len(held) == 2 and bm.num_free_blocks() == 2


def _finish(bm, ids):
    """Allocate, 'compute', register and free a request; returns its table."""
    table, cached = bm.allocate(ids, len(ids))
    hashes = []
    bm.register_full_blocks(table, hashes, len(ids), ids)
    bm.free(table)
    return table, cached


def test_prefix_reuse_after_free():
    bm = BlockManager(8, BS)
    prompt = list(range(11))  # 2 full blocks + 3 tokens
    t1, cached = _finish(bm, prompt)
    assert cached == 0 and bm.num_cached_blocks() == 2 and bm.num_free_blocks() == 8
    t2, cached = bm.allocate(prompt[:9] + [99, 98], 11)
    assert cached == 8 and t2[:2] == t1[:2]
    assert bm.ref_count(t2[0]) == 1 and bm.prefix_hits == 2
    # a prompt that is exactly the cached blocks reuses all but the last block
    t3, cached3 = bm.allocate(prompt[:8], 8)
    assert cached3 == 4 and t3[0] == t1[0] and bm.ref_count(t1[0]) == 2
    bm.free(t2)
    bm.free(t3)
    assert bm.num_free_blocks() == 8


def test_shared_block_is_not_freed_while_held():
    bm = BlockManager(4, BS)
    prompt = list(range(9))
    _finish(bm, prompt)
    a, _ = bm.allocate(prompt, 9)
    b, _ = bm.allocate(prompt, 9)
    assert a[:2] == b[:2] and bm.ref_count(a[0]) == 2
    bm.free(a)
    assert bm.ref_count(b[0]) == 1
    # the shared blocks must not be handed out while b holds them
    with pytest.raises(OutOfBlocksError):
        bm.allocate([50] * 12, 12)
    c, _ = bm.allocate([50], 1)
    assert c[0] not in b
    bm.free(b)
    bm.free(c)
    assert bm.num_free_blocks() == 4


def test_lru_evicts_oldest_cached_block_first():
    bm = BlockManager(3, BS)
    old, _ = _finish(bm, [1, 1, 1, 1, 0])
    new, _ = _finish(bm, [2, 2, 2, 2, 0])
    assert bm.num_cached_blocks() == 2
    fresh, _ = bm.allocate([3], 4)  # takes the never-hashed block first
    assert fresh[0] not in (old[0], new[0])
    more, _ = bm.allocate([4], 4)  # then evicts the least recently freed
    assert more[0] == old[0]
    assert bm.match_prefix([2, 2, 2, 2, 0]) == [new[0]]
    assert bm.match_prefix([1, 1, 1, 1, 0]) == []
    bm.free(fresh)
    bm.free(more)


def test_prefix_cache_disabled():
    bm = BlockManager(4, BS, enable_prefix_cache=False)
    _finish(bm, list(range(9)))
    _, cached = bm.allocate(list(range(9)), 9)
    assert cached == 0 and bm.num_cached_blocks() == 0


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="num_blocks must be positive"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size must be positive"):
        BlockManager(4, 0)
