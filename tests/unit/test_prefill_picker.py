"""DecodePicker: weighted round robin on free KV memory, round robin, expiry, version filter."""

from collections import Counter

import pytest

from pdserve.prefill_server.picker import DecodeLoad, DecodePicker
from pdserve.protos.version import PROTOCOL_VERSION


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _picker(policy, clock=None, **loads):
    p = DecodePicker(policy=policy, expiry_s=1.0, clock=clock or Clock())
    for addr, free in loads.items():
        p.update(addr, DecodeLoad(free_blocks=free, free_bytes=free * 1000))
    return p


def test_wrr_half_free_memory_gets_a_third():
    p = _picker("wrr", a=100, b=50)
    counts = Counter(p.pick() for _ in range(300))
    assert counts == {"a": 200, "b": 100}


def test_wrr_interleaves_instead_of_bursting():
    p = _picker("wrr", a=100, b=50)
    seq = [p.pick() for _ in range(6)]
    assert seq.count("b") == 2 and seq[:3].count("b") == 1


def test_rr_splits_evenly_regardless_of_memory():
    p = _picker("rr", a=100, b=50)
    counts = Counter(p.pick() for _ in range(300))
    assert counts == {"a": 150, "b": 150}


def test_stale_report_expires_and_fresh_one_revives():
    clock = Clock()
    p = _picker("wrr", clock, a=100)
    assert p.pick() == "a"
    clock.t += 1.5
    assert p.pick() is None
    assert "stale" in p.why_none()
    p.update("a", DecodeLoad(free_blocks=10, free_bytes=10))
    assert p.pick() == "a"


def test_with_a_poller_a_report_expires_by_missed_rounds_not_a_pause():
    # The prefill process was paused for 5 s (no poll round ran): on resuming, the last reports
    # are old by the clock but no round has asked again yet, so they still count.
    clock = Clock()
    p = _picker("wrr", clock, a=100)
    p.stale_rounds = 2
    p.round_started()
    p.update("a", DecodeLoad(free_blocks=100, free_bytes=100))
    clock.t += 5.0
    assert p.pick() == "a"
    p.round_started()  # one round without an answer: not yet stale
    assert p.pick() == "a"
    p.round_started()
    p.round_started()  # three rounds without an answer and old by the clock: stale
    assert p.pick() is None
    assert "stale" in p.why_none()
    p.update("a", DecodeLoad(free_blocks=100, free_bytes=100))
    assert p.pick() == "a"


def test_missed_rounds_alone_do_not_expire_a_recent_report():
    clock = Clock()
    p = _picker("wrr", clock, a=100)
    p.stale_rounds = 2
    for _ in range(10):
        p.round_started()
    assert p.pick() == "a"  # rounds ran quickly, but the report is younger than expiry_s


def test_protocol_version_draining_and_full_are_filtered():
    p = _picker("wrr", a=100)
    p.update("old", DecodeLoad(free_blocks=100, free_bytes=10**9, protocol_version=PROTOCOL_VERSION + 1))
    p.update("drain", DecodeLoad(free_blocks=100, free_bytes=10**9, draining=True))
    p.update("full", DecodeLoad(free_blocks=0, free_bytes=0))
    assert {p.pick() for _ in range(20)} == {"a"}
    p.forget("a")
    assert p.pick() is None
    reason = p.why_none()
    assert "protocol version" in reason and "draining" in reason and "no free KV blocks" in reason


def test_exclude_gives_next_decode():
    p = _picker("wrr", a=100, b=50)
    assert p.pick(exclude={"a"}) == "b"
    assert p.pick(exclude={"a", "b"}) is None


def test_note_allocation_shifts_weight_until_next_report():
    p = _picker("wrr", a=100, b=100)
    p.note_allocation("a", 90, 90_000)
    counts = Counter(p.pick() for _ in range(110))
    assert counts["b"] > 3 * counts["a"]


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="unknown routing policy"):
        DecodePicker(policy="random")
    with pytest.raises(ValueError, match="free_blocks"):
        DecodeLoad(free_blocks=-1, free_bytes=0)


def test_wrr_skips_decodes_too_full_for_the_request():
    p = DecodePicker(policy="wrr", clock=lambda: 0.0)
    p.update("small", DecodeLoad(free_blocks=13, free_bytes=13 * 1024))
    p.update("big", DecodeLoad(free_blocks=80, free_bytes=80 * 1024))
    # a 27-block request never goes to the decode that reported 13 free blocks
    assert {p.pick(blocks_needed=27) for _ in range(50)} == {"big"}
    # small requests still spread by weight over both
    assert {p.pick(blocks_needed=3) for _ in range(50)} == {"small", "big"}
    # nobody can hold 100 blocks: None, "busy" (worth waiting), and the reason names the numbers
    assert p.pick(blocks_needed=100) is None
    assert p.all_full(100)
    assert "13 free KV blocks, 100 needed" in p.why_none(100)


def test_rr_stays_size_blind():
    p = DecodePicker(policy="rr", clock=lambda: 0.0)
    p.update("small", DecodeLoad(free_blocks=13, free_bytes=13 * 1024))
    p.update("big", DecodeLoad(free_blocks=80, free_bytes=80 * 1024))
    assert {p.pick(blocks_needed=27) for _ in range(4)} == {"small", "big"}


def test_request_larger_than_every_pool_is_not_worth_waiting_for():
    p = DecodePicker(policy="wrr", clock=lambda: 0.0)
    p.update("a", DecodeLoad(free_blocks=8, free_bytes=8, total_blocks=8))
    p.update("b", DecodeLoad(free_blocks=2, free_bytes=2, total_blocks=16))
    assert p.pick(blocks_needed=11) is None
    assert p.all_full(11)  # b could hold 11 once its running requests finish
    p.update("b", DecodeLoad(free_blocks=2, free_bytes=2, total_blocks=10))
    assert not p.all_full(11)  # nobody ever can
    assert "holds only 8 KV blocks in all, 11 needed" in p.why_none(11)


@pytest.mark.parametrize("policy", ["wrr", "rr"])
def test_never_fits_names_the_largest_pool(policy):
    p = DecodePicker(policy=policy, clock=lambda: 0.0)
    assert p.never_fits(11) is None  # nobody reported yet: not known to be too large
    p.update("a", DecodeLoad(free_blocks=8, free_bytes=8, total_blocks=8))
    p.update("b", DecodeLoad(free_blocks=0, free_bytes=0, total_blocks=16))
    assert p.never_fits(11) is None  # b can, once it has room (any policy)
    assert p.never_fits(17) == 16
    p.update("c", DecodeLoad(free_blocks=4, free_bytes=4))  # a decode that does not report its pool
    assert p.never_fits(17) is None
def test_prefix_holder_wins_against_somewhat_more_free_memory():
    p = _picker("wrr", a=100, b=60)
    # b holds 8 of the prompt's 10 reusable blocks: 0.8 + 0.6 beats a's 0 + 1.0, every time
    assert [p.pick(overlap={"b": 8}, prompt_blocks=10) for _ in range(5)] == ["b"] * 5
    # a little prefix does not outweigh much less free memory: 0.2 + 0.6 < 1.0
    assert p.pick(overlap={"b": 2}, prompt_blocks=10) == "a"


def test_prefix_never_picks_a_decode_that_cannot_hold_the_request():
    p = _picker("wrr", a=100, b=3)
    assert p.pick(blocks_needed=5, overlap={"b": 10}, prompt_blocks=10) == "a"
    assert p.pick(blocks_needed=5, exclude={"a"}, overlap={"b": 10}, prompt_blocks=10) is None


def test_equal_prefixes_fall_back_to_weighted_round_robin():
    p = _picker("wrr", a=100, b=50)
    counts = Counter(p.pick(overlap={"a": 3, "b": 3}, prompt_blocks=4) for _ in range(300))
    assert counts == {"a": 200, "b": 100}


def test_rr_ignores_prefixes():
    p = _picker("rr", a=100, b=50)
    counts = Counter(p.pick(overlap={"b": 9}, prompt_blocks=10) for _ in range(10))
    assert counts == {"a": 5, "b": 5}


def test_a_shared_prefix_pile_up_is_bounded_by_free_memory():
    # Every request shares a system prompt that only b holds (3 of 10 blocks). b gets requests
    # until its free memory is below 70% of a's, then a gets one (and would hold it too).
    p = _picker("wrr", a=100, b=100)
    picks = []
    for _ in range(20):
        address = p.pick(overlap={"b": 3}, prompt_blocks=10)
        picks.append(address)
        if address == "a":
            break
        p.note_allocation(address, 5, 5000)
    assert picks[-1] == "a" and 5 <= picks.count("b") <= 7, picks


def test_a_decode_in_a_kv_pool_counts_what_its_peers_can_lend():
    # a: 8 blocks of its own, its pool lends 6 now and 14 at most; b: 8 blocks, no pool
    p = DecodePicker(policy="wrr", expiry_s=1.0, clock=Clock())
    p.update("a", DecodeLoad(free_blocks=8, free_bytes=8000, total_blocks=8, pool_free_blocks=6, pool_total_blocks=14))
    p.update("b", DecodeLoad(free_blocks=8, free_bytes=8000, total_blocks=8))
    assert p.eligible(blocks_needed=14) == ["a"]  # 8 free + 6 lendable now
    assert p.eligible(blocks_needed=15) == []
    assert p.all_full(15)  # a can hold 22 once its peers have room again: worth waiting
    assert p.never_fits(22) is None
    assert p.never_fits(23) == 22  # 8 + 14: more than any decode and its pool
    assert "holds only 22 KV blocks in all" in p.why_none(23)
