"""The round-robin baseline policy: blind to cache and load, each prefill in turn, the rest as retries."""

import pytest

from pdserve.router.choice import Candidate, round_robin


def cands():
    return [Candidate("b:1", 9, 5, 0, 16), Candidate("a:1", 0, 0, 100, 16), Candidate("c:1", 2, 1, 10, 16)]


def test_round_robin_takes_prefills_in_address_order_whatever_their_cache_and_load():
    picks = [round_robin(cands(), turn) for turn in range(6)]
    assert [c.address for c in picks] == ["a:1", "b:1", "c:1"] * 2
    assert {c.reason for c in picks} == {"round_robin"}
    assert picks[1].ranking == ("b:1", "c:1", "a:1")
    assert picks[1].overlap_blocks == 9


def test_round_robin_needs_a_candidate():
    with pytest.raises(ValueError, match="no candidate"):
        round_robin([], 0)
