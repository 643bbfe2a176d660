"""Which prefill and decode tensor-parallel sizes pair (engine/tp/heads.pairing_error), the decode's admission
refusing the others naming both sizes (decode_server/admission.py), and the CacheStore's CompatInfo carrying a
region's KV head range (a region with part of the heads never binds to one with another part, or all of them;
a region with every head hashes as before the range existed). The per-rank push's plan (heads.rank_sources:
which prefill rank feeds each decode rank, None where a decode rank would need part of a prefill rank's
blocks), its pieces since version 2 (heads.rank_pieces: each decode rank's heads once, a slice of a prefill
rank's shard or several prefill ranks' shards) and the decode's rule for offering it (the prefill's
Compat.kv_push a version we speak, slices only at version 2 and where this decode can make them:
decode_server/rank_receivers.py)."""

import pytest

from pdserve.cachestore import CompatInfo
from pdserve.decode_server import admission
from pdserve.decode_server.rank_receivers import RankReceivers
from pdserve.engine.tp.heads import kv_head_ranges, pairing_error, rank_pieces, rank_sources
from pdserve.protos import session_pb2 as pb
from pdserve.protos.version import KV_PUSH_VERSION, PROTOCOL_VERSION


@pytest.mark.parametrize("heads, p, d", [(2, 1, 2), (2, 2, 1), (2, 2, 2), (2, 4, 2), (2, 1, 4), (1, 2, 4), (8, 4, 2),
                                          (6, 3, 6), (4, 4, 1)])
def test_sizes_whose_head_shards_nest_pair(heads, p, d):
    assert pairing_error(heads, p, d) is None


def test_sizes_that_do_not_divide_one_another_are_refused_naming_both():
    why = pairing_error(6, 2, 3)
    assert why is not None and "prefill tensor-parallel size 2 and decode tensor-parallel size 3" in why
    assert "do not divide one another" in why and "6 KV heads" in why
    why = pairing_error(4, 3, 1)
    assert why is not None and "size 3 and decode tensor-parallel size 1" in why and "4 KV heads" in why


def test_kv_head_ranges_split_or_replicate():
    assert kv_head_ranges(4, 2) == [range(0, 2), range(2, 4)]
    assert kv_head_ranges(2, 4) == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]


def _compat(tp: int) -> pb.Compat:
    return pb.Compat(dtype="float32", num_layers=2, num_kv_heads=6, head_dim=16, block_size=16, model="m",
                     transport="tcp", tensor_parallel_size=tp)


def _start(tp: int) -> pb.Start:
    return pb.Start(request_id="r", prompt_token_ids=[1, 2, 3], blocks_needed=1, compat=_compat(tp),
                    protocol_version=PROTOCOL_VERSION, sampling=pb.Sampling(max_tokens=4))


def _refusal(prefill_tp: int, decode_tp: int):
    return admission.refusal(_start(prefill_tp), _compat(decode_tp), max_model_len=64, total_blocks=8,
                             draining=False, has_session=False)


def test_the_decode_refuses_a_prefill_whose_tp_size_does_not_pair_with_its_own():
    code, reason = _refusal(2, 3)
    assert code == "incompatible"
    assert "prefill tensor-parallel size 2 and decode tensor-parallel size 3" in reason, reason
    assert _refusal(2, 1) is None and _refusal(1, 2) is None and _refusal(3, 6) is None
    old_prefill = _start(0)  # a peer from before the field: TP 1
    assert admission.refusal(old_prefill, _compat(2), max_model_len=64, total_blocks=8, draining=False,
                             has_session=False) is None


def test_compat_info_carries_a_regions_head_range():
    whole = CompatInfo("float32", 2, 4, 16, 16)
    assert CompatInfo("float32", 2, 4, 16, 16, model_kv_heads=4).compat_hash == whole.compat_hash
    half = CompatInfo("float32", 2, 2, 16, 16, first_kv_head=2, model_kv_heads=4)
    other = CompatInfo("float32", 2, 2, 16, 16, first_kv_head=0, model_kv_heads=4)
    assert "kv_heads=2(2..3 of 4)" in half.describe()
    assert len({half.compat_hash, other.compat_hash, whole.compat_hash}) == 3
    with pytest.raises(ValueError, match="KV heads 3..4 are not heads of a model with 4"):
        CompatInfo("float32", 2, 2, 16, 16, first_kv_head=3, model_kv_heads=4)


@pytest.mark.parametrize("heads, p, d, sources", [
    (2, 2, 2, [0, 1]),  # equal sizes: rank to rank
    (8, 4, 4, [0, 1, 2, 3]),
    (1, 1, 2, [0, 0]),  # one KV head, replicated on both decode ranks: the TP 1 prefill feeds both
    (1, 2, 1, [0]),  # replicated on both prefill ranks: one of them sends
    (2, 4, 2, [0, 3]),  # each head on two prefill ranks: spread over them
    (2, 1, 4, None),  # a decode rank holds head 0 only, the TP 1 prefill's blocks hold both heads
    (2, 1, 2, None), (2, 2, 1, None), (4, 2, 4, None), (8, 4, 2, None),
    (6, 2, 3, None),  # not even paired
])
def test_rank_sources_pair_each_decode_rank_with_a_prefill_rank_of_exactly_its_heads(heads, p, d, sources):
    assert rank_sources(heads, p, d) == sources


def test_the_decode_offers_the_per_rank_push_only_to_a_prefill_that_speaks_it_and_pairs():
    ranks = RankReceivers([object(), object()], num_kv_heads=2, landed=set())  # type: ignore[list-item]
    speaks = pb.Compat(num_kv_heads=2, tensor_parallel_size=2, kv_push=KV_PUSH_VERSION)
    assert ranks.pairs_with(speaks)
    assert not ranks.pairs_with(pb.Compat(num_kv_heads=2, tensor_parallel_size=2))  # older peer, or --kv-push gather
    assert not ranks.pairs_with(pb.Compat(num_kv_heads=2, tensor_parallel_size=2, kv_push=KV_PUSH_VERSION + 1))
    # TP 1 into TP 2 on 2 KV heads: a slice of the prefill's heads per decode rank, packed by the prefill (version 2)
    assert ranks.pairs_with(pb.Compat(num_kv_heads=2, tensor_parallel_size=1, kv_push=KV_PUSH_VERSION))
    assert not ranks.pairs_with(pb.Compat(num_kv_heads=2, tensor_parallel_size=1, kv_push=1))  # v1: whole shards
    one_head = RankReceivers([object(), object()], num_kv_heads=1, landed=set())  # type: ignore[list-item]
    assert one_head.pairs_with(pb.Compat(num_kv_heads=1, tensor_parallel_size=0, kv_push=KV_PUSH_VERSION))  # TP 1
    tp1 = RankReceivers([object()], num_kv_heads=2, landed=set())  # type: ignore[list-item]
    assert not tp1.pairs_with(pb.Compat(num_kv_heads=2, tensor_parallel_size=1, kv_push=KV_PUSH_VERSION))


@pytest.mark.parametrize("heads, p, d, pieces", [
    # (decode rank, prefill rank, heads, whole at the source, whole at the destination)
    (2, 2, 2, [(0, 0, (0, 1), True, True), (1, 1, (1, 2), True, True)]),  # rank to rank
    (2, 1, 2, [(0, 0, (0, 1), False, True), (1, 0, (1, 2), False, True)]),  # a slice of the TP 1 prefill's heads
    (2, 2, 1, [(0, 0, (0, 1), True, False), (0, 1, (1, 2), True, False)]),  # both prefill ranks into one decode rank
    (2, 1, 4, [(0, 0, (0, 1), False, True), (1, 0, (0, 1), False, True), (2, 0, (1, 2), False, True),
               (3, 0, (1, 2), False, True)]),  # replicated on the decode: one slice packed for two ranks
    (2, 4, 1, [(0, 0, (0, 1), True, False), (0, 2, (1, 2), True, False)]),  # replicated on the prefill: one holder
    (8, 4, 2, [(0, 0, (0, 2), True, False), (0, 1, (2, 4), True, False), (1, 2, (4, 6), True, False),
               (1, 3, (6, 8), True, False)]),
    (1, 1, 2, [(0, 0, (0, 1), True, True), (1, 0, (0, 1), True, True)]),  # one KV head: whole everywhere
    (1, 2, 1, [(0, 0, (0, 1), True, True)]),
])
def test_rank_pieces_give_each_decode_rank_each_of_its_heads_once(heads, p, d, pieces):
    got = rank_pieces(heads, p, d)
    assert got is not None
    assert [(x.decode_rank, x.prefill_rank, (x.heads.start, x.heads.stop), x.whole_source, x.whole_dest)
            for x in got] == pieces
    for rank, mine in enumerate(kv_head_ranges(heads, d)):  # every head of every decode rank exactly once
        assert sorted(h for x in got if x.decode_rank == rank for h in x.heads) == list(mine)
    assert rank_pieces(6, 2, 3) is None


def test_whole_shard_pieces_agree_with_the_version_1_plan():
    """A version-1 prefill computes its sources with rank_sources: the pieces of a whole-shard pairing match."""
    for heads, p, d in [(2, 2, 2), (8, 4, 4), (1, 1, 2), (1, 2, 1), (2, 4, 2), (1, 4, 2)]:
        pieces = rank_pieces(heads, p, d)
        assert pieces is not None and [x.prefill_rank for x in pieces] == rank_sources(heads, p, d)


def test_the_decode_offers_slices_only_to_a_prefill_of_version_2_and_when_it_can_make_them():
    async def make(rank, heads):  # never called: plan() only decides
        raise AssertionError

    tp2 = RankReceivers([object(), object()], num_kv_heads=2, landed=set(), make_slice=make)  # type: ignore[list-item]
    v2 = pb.Compat(num_kv_heads=2, tensor_parallel_size=1, kv_push=2)
    assert [x.heads for x in tp2.plan(v2) or []] == [range(0, 1), range(1, 2)]  # P1 -> D2: the prefill packs
    assert tp2.plan(pb.Compat(num_kv_heads=2, tensor_parallel_size=1, kv_push=1)) is None  # v1 sends whole shards
    assert tp2.plan(pb.Compat(num_kv_heads=2, tensor_parallel_size=2, kv_push=1)) is not None  # whole: v1 is fine
    tp1 = RankReceivers([object()], num_kv_heads=2, landed=set(), make_slice=make)  # type: ignore[list-item]
    assert len(tp1.plan(pb.Compat(num_kv_heads=2, tensor_parallel_size=2, kv_push=2)) or []) == 2  # we unpack
    no_slices = RankReceivers([object()], num_kv_heads=2, landed=set(), version=1)  # type: ignore[list-item]
    assert no_slices.plan(pb.Compat(num_kv_heads=2, tensor_parallel_size=2, kv_push=2)) is None  # a GPU decode
