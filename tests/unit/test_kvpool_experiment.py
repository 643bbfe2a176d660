"""The long-context experiment's arithmetic (no processes): the spill cost split and the search."""

from pdserve.bench.experiments import long_context
from pdserve.bench.experiments.long_context import spill_costs


def test_spill_costs_split_the_first_lender_from_each_further_block():
    rows = [{"spilled_blocks": b, "decode_ms_per_token": ms, "decode_ms_min": ms - 1}
            for b, ms in [(0, 5.0), (1, 9.0), (2, 9.5), (3, 10.0)]]
    got = spill_costs(rows)
    assert got["local_decode_ms_per_token"] == 5.0 and got["local_decode_ms_min"] == 4.0
    assert got["first_lender_ms"] == 4.0 and got["first_lender_ms_from_minima"] == 4.0
    assert got["per_further_block_ms"] == 0.5
    assert got["slowdown_ms_per_spilled_block"] == 1.55  # least squares over 0..3: 7.75 / 5


def test_longest_finds_the_last_length_that_completes(monkeypatch):
    limit, asked = 777, []

    def completes(cluster, n, max_tokens, pooled):
        asked.append(n)
        return n <= limit

    monkeypatch.setattr(long_context, "_completes", completes)
    assert long_context.longest(None, 16, True, upper=2048) == limit
    assert len(asked) <= 12  # a binary search, not a scan
    monkeypatch.setattr(long_context, "_completes", lambda *a: False)
    assert long_context.longest(None, 16, True, upper=2048) == 0
