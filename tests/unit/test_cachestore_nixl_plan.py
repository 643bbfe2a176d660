"""nixl_plan: what one NIXL WRITE carries (pure): runs merged only where adjacent on BOTH
sides, a layer's chunks grouped back into one record, descriptors in both regions."""

from pdserve.cachestore.nixl_plan import group_layers, layer_descriptors, merge_runs_ordered
from pdserve.cachestore.scheduler import Chunk, PriorityScheduler, Transfer


def test_adjacent_on_both_sides_merge():
    assert merge_runs_ordered([(0, 10, 2), (2, 12, 3), (5, 15, 1)]) == [(0, 10, 6)]


def test_adjacent_on_one_side_only_do_not_merge():
    # source contiguous, destination not
    assert merge_runs_ordered([(0, 10, 2), (2, 20, 2)]) == [(0, 10, 2), (2, 20, 2)]
    # destination contiguous, source not
    assert merge_runs_ordered([(0, 10, 2), (5, 12, 2)]) == [(0, 10, 2), (5, 12, 2)]
    # a gap on both sides
    assert merge_runs_ordered([(0, 10, 2), (3, 13, 2)]) == [(0, 10, 2), (3, 13, 2)]


def test_order_is_kept_and_only_neighbours_merge():
    # (4, 14) follows (0, 10, 4) in memory but comes after an unrelated run: not merged back
    runs = [(0, 10, 4), (30, 40, 1), (4, 14, 2), (6, 16, 1)]
    assert merge_runs_ordered(runs) == [(0, 10, 4), (30, 40, 1), (4, 14, 3)]
    # backwards neighbours are not merged (a descriptor runs forwards)
    assert merge_runs_ordered([(4, 14, 2), (2, 12, 2)]) == [(4, 14, 2), (2, 12, 2)]
    assert merge_runs_ordered([]) == [] and merge_runs_ordered([(1, 1, 0), (7, 8, 1)]) == [(7, 8, 1)]


def _chunks(scheduler, transfers):
    for t in transfers:
        scheduler.push(t)
    out = []
    while len(scheduler):
        out.append(scheduler.pop())
    return out


def test_a_layer_cut_into_chunks_is_one_record_again():
    long = Transfer("a", 3, [(0, 100, 40), (50, 200, 10)])  # 50 blocks, cut into chunks of 16
    chunks = _chunks(PriorityScheduler(chunk_blocks=16), [long])
    assert len(chunks) == 4 and all(isinstance(c, Chunk) for c in chunks)
    assert group_layers(chunks) == [(long, [(0, 100, 40), (50, 200, 10)])]


def test_short_transfers_between_chunks_keep_their_own_records_in_first_seen_order():
    sched = PriorityScheduler(chunk_blocks=4)
    long = Transfer("long", 0, [(0, 0, 10)])
    sched.push(long)
    first = sched.pop()  # the long transfer's first chunk is on its way
    short = Transfer("short", 0, [(20, 30, 1)])
    rest = _chunks(sched, [short])  # the short one overtakes the rest of the long one
    assert [c.transfer.key for c in [first, *rest]] == ["long", "short", "long", "long"]
    assert group_layers([first, *rest]) == [(long, [(0, 0, 10)]), (short, [(20, 30, 1)])]


def test_layer_descriptors_in_both_regions():
    kw = dict(block_nbytes=100, src_base=10_000, src_num_blocks=8, dst_base=50_000, dst_num_blocks=16)
    # layer 2: src block b at 10_000 + (16 + b) * 100, dst block d at 50_000 + (32 + d) * 100
    assert layer_descriptors(2, [(1, 5, 2), (3, 7, 1)], **kw) == [(10_000 + 1700, 50_000 + 3700, 300)]
    assert layer_descriptors(2, [(1, 5, 2), (3, 9, 1)], **kw) == [(11_700, 53_700, 200), (11_900, 54_100, 100)]


def test_layers_adjacent_on_both_sides_merge_across_layers():
    # both pools have 4 blocks per layer and the whole layer goes: layer 0's end touches layer 1's start
    kw = dict(block_nbytes=10, src_base=0, src_num_blocks=4, dst_base=1000, dst_num_blocks=4)
    both = layer_descriptors(0, [(0, 0, 4)], **kw) + layer_descriptors(1, [(0, 0, 4)], **kw)
    assert merge_runs_ordered(both) == [(0, 1000, 80)]
    # with different pool sizes the layers are not adjacent on the receiver: two descriptors
    kw["dst_num_blocks"] = 6
    both = layer_descriptors(0, [(0, 0, 4)], **kw) + layer_descriptors(1, [(0, 0, 4)], **kw)
    assert merge_runs_ordered(both) == [(0, 1000, 40), (40, 1060, 40)]
