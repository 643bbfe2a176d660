"""The scale experiment's workloads (bench/experiments/scale_workload.py): the whole trace at real lengths with
shared blocks made lazily, the reuse bound of a perfect prefix cache, and the compressed day's cycle."""

import math

import pytest

from pdserve.bench.experiments.scale_workload import (BLOCK, BlockPrompt, DayCycle, conversations, daily_cycle,
                                                      full_workload, rate_by_bin, reuse_bound, unqueued_ttft)
from pdserve.bench.trace_replay import TraceRequest


def _conversations(n: int, turns: int = 3, gap: float = 5.0) -> list[TraceRequest]:
    """n conversations of ``turns`` turns (block 0 shared by all), turn k of each ``gap * k`` s after its first."""
    out = []
    for c in range(n):
        for turn in range(turns):
            ids = (0, 1000 + c, *range(10_000 * (c + 1), 10_000 * (c + 1) + turn))
            out.append(TraceRequest(float(c) + gap * turn, BLOCK * len(ids), 10, ids))
    return sorted(out, key=lambda r: r.time_s)


def test_full_workload_keeps_every_request_its_lengths_and_shared_blocks():
    reqs = [TraceRequest(10.0, 1200, 7, (0, 1, 2)), TraceRequest(12.0, 700, 9, (0, 1)),
            TraceRequest(20.0, 1600, 3, (0, 5, 6))]  # the third is 64 tokens past its ids: its own tail
    specs, arrivals = full_workload(reqs, speedup=2.0, seed=1)
    assert [(s.prompt_tokens, s.output_tokens) for s in specs] == [(1200, 7), (700, 9), (1600, 3)]
    assert arrivals == [0.0, 1.0, 5.0]  # from the first arrival, / speedup
    ids = [list(s.prompt_ids) for s in specs]
    assert [len(i) for i in ids] == [1200, 700, 1600] and all(1 <= t <= 255 for i in ids for t in i)
    assert ids[0][:700] == ids[1]  # ids (0, 1): the same tokens; the second is cut inside block 1
    assert ids[0][:BLOCK] == ids[2][:BLOCK] and ids[0][BLOCK:2 * BLOCK] != ids[2][BLOCK:2 * BLOCK]
    assert ids == [list(s.prompt_ids) for s in full_workload(reqs, 2.0, seed=1)[0]]  # the same every time
    assert ids[0] != list(full_workload(reqs, 2.0, seed=2)[0][0].prompt_ids)
    assert specs[1].prompt_ids[699] == ids[1][699] and len(specs[2].prompt_ids) == 1600
    with pytest.raises(ValueError, match="speedup"):
        full_workload(reqs, speedup=0)


def test_block_prompt_iterates_blocks_then_tail_cut_at_its_length():
    p = BlockPrompt((b"\x01\x02\x03", b"\x04\x05"), b"\x06\x07", 6)
    assert list(p) == [1, 2, 3, 4, 5, 6] and len(p) == 6 and p[-1] == 6
    assert list(BlockPrompt((b"\x01\x02\x03",), b"", 2)) == [1, 2]


def test_reuse_bound_counts_leading_blocks_a_perfect_cache_holds():
    reqs = [TraceRequest(0, 3 * BLOCK, 1, (0, 1, 2)),   # nothing cached yet
            TraceRequest(1, 3 * BLOCK, 1, (0, 1, 3)),   # 2 leading blocks seen
            TraceRequest(2, 2 * BLOCK, 1, (0, 1)),      # all seen, but the last token is always computed
            TraceRequest(3, 2 * BLOCK, 1, (9, 1))]      # block 1 after another first block: not a prefix hit
    b = reuse_bound(reqs, n_prefills=1)
    total = 10 * BLOCK
    assert b["prompt_tokens"] == total
    assert b["one_cache"] == pytest.approx((2 * BLOCK + 2 * BLOCK - 1) / total)
    assert b["one_cache"] == b["round_robin"]  # one prefill: round robin is the one cache
    rr = reuse_bound(reqs, n_prefills=2)  # requests 0, 2 on one cache; 1, 3 on the other
    assert rr["round_robin"] == pytest.approx((2 * BLOCK - 1) / total)
    assert rr["one_cache"] == b["one_cache"]
    with pytest.raises(ValueError, match="prefill"):
        reuse_bound(reqs, 0)


def test_day_cycle_rate_has_its_mean_trough_and_peak():
    c = DayCycle(day_s=100.0, mean_rate=2.0, peak_to_trough=4.0)
    assert c.rate(0) == pytest.approx(0.8) and c.rate(50) == pytest.approx(3.2) and c.peak_rate == pytest.approx(3.2)
    assert c.rate(50) / c.rate(0) == pytest.approx(4.0)
    mean = sum(c.rate(t + 0.5) for t in range(100)) / 100
    assert mean == pytest.approx(2.0, rel=1e-3)
    with pytest.raises(ValueError):
        DayCycle(100.0, 1.0, 0.5)


def test_daily_cycle_follows_the_curve_and_keeps_conversations_whole():
    reqs = _conversations(400, turns=3, gap=5.0)  # 400 conversations over ~410 s: ~1 per s
    day, cycle = daily_cycle(reqs, day_s=2000.0, peak_to_trough=4.0, load=1.0, seed=3)
    assert cycle.mean_rate == pytest.approx(400 / (399 + 10))
    starts = [r.time_s for r in day if r.input_length == 2 * BLOCK]  # a conversation's first turn: 2 blocks
    assert len(starts) == pytest.approx(cycle.mean_rate * 2000, rel=0.1)
    quarter = [sum(1 for t in starts if q * 500 <= t < (q + 1) * 500) for q in range(4)]
    middle, edges = quarter[1] + quarter[2], quarter[0] + quarter[3]
    expected = (1 + 2 * cycle.amplitude / math.pi) / (1 - 2 * cycle.amplitude / math.pi)  # integral of the curve
    assert middle / edges == pytest.approx(expected, rel=0.2)
    assert day == sorted(day, key=lambda r: r.time_s) and all(0 <= r.time_s < 2000 for r in day)
    assert all(r.hash_ids[0] == 0 for r in day)  # the shared block stays shared
    by_conv = conversations(day)
    assert all(len(c) <= 3 for c in by_conv)  # copies of one conversation do not share private ids
    whole = [c for c in by_conv if c[0].time_s < 1900]
    assert all(len(c) == 3 and [r.time_s - c[0].time_s for r in c] == pytest.approx([0, 5, 10]) for c in whole)
    assert daily_cycle(reqs, 2000.0, 4.0, 1.0, seed=3)[0] == day
    double, _ = daily_cycle(reqs, 2000.0, 4.0, load=2.0, seed=3)
    assert len(double) == pytest.approx(2 * len(day), rel=0.15)


def test_rate_by_bin_counts_arrivals_per_second_of_each_bin():
    assert rate_by_bin([0.0, 1.0, 2.5, 9.9, 10.0], day_s=10.0, bins=2) == [0.6, 0.2]
    with pytest.raises(ValueError):
        rate_by_bin([], 10.0, 0)


def test_unqueued_ttft_computes_only_what_the_caches_miss():
    reqs = [TraceRequest(0, 2 * BLOCK, 1, (0, 1)), TraceRequest(1, 3 * BLOCK, 1, (0, 1, 2)),
            TraceRequest(2, 3 * BLOCK, 1, (0, 1, 3))]
    cost = lambda new, cached: new + cached / 1000  # noqa: E731 - a stand-in for StepTime.prefill_s
    one = unqueued_ttft(reqs, cost, n_prefills=2, one_cache=True)
    assert one == [2 * BLOCK, BLOCK + 2 * BLOCK / 1000, BLOCK + 2 * BLOCK / 1000]
    rr = unqueued_ttft(reqs, cost, n_prefills=2, one_cache=False)  # request 1 on the other, empty cache
    assert rr == [2 * BLOCK, 3 * BLOCK, BLOCK + 2 * BLOCK / 1000]


def test_turn_pace_divides_a_conversations_waits_between_turns():
    reqs = _conversations(400, turns=3, gap=30.0)
    day, _ = daily_cycle(reqs, day_s=2000.0, peak_to_trough=3.0, seed=3, turn_pace=10.0)
    whole = [c for c in conversations(day) if c[0].time_s < 1900]
    assert whole and all([r.time_s - c[0].time_s for r in c] == pytest.approx([0, 3, 6]) for c in whole)
    with pytest.raises(ValueError, match="turn_pace"):
        daily_cycle(reqs, 2000.0, turn_pace=0)


def test_a_day_of_the_mooncake_trace_keeps_its_lengths_and_its_reuse():
    """The day the scale experiment runs (240 s, turn pace 10): the trace's prompt and output lengths (median and
    p90 within 10%) and the share of prompt tokens a perfect prefix cache serves (within 5 points); at the users'
    own pace the same day loses most of that reuse (the second turns fall after it ends)."""
    from pdserve.bench.trace_replay import MOONCAKE_TRACE, read_trace

    reqs = read_trace(MOONCAKE_TRACE, "mooncake")
    day, cycle = daily_cycle(reqs, day_s=240.0, peak_to_trough=3.0, seed=0, turn_pace=10.0)

    def q(values, p):
        return sorted(values)[int(p * len(values))]

    for length in ("input_length", "output_length"):
        for p in (0.5, 0.9):
            trace_q, day_q = q([getattr(r, length) for r in reqs], p), q([getattr(r, length) for r in day], p)
            assert day_q == pytest.approx(trace_q, rel=0.1), (length, p)
    trace_reuse = reuse_bound(reqs)["one_cache"]
    assert reuse_bound(day)["one_cache"] == pytest.approx(trace_reuse, abs=0.05)
    slow, _ = daily_cycle(reqs, day_s=240.0, peak_to_trough=3.0, seed=0)
    assert reuse_bound(slow)["one_cache"] < trace_reuse / 2
    per_bin = rate_by_bin([r.time_s for r in day], 240.0, 4)  # the middle of the day busier than its ends
    assert per_bin[1] + per_bin[2] > 1.5 * (per_bin[0] + per_bin[3])
    assert len(day) / 240.0 == pytest.approx(len(reqs) / (reqs[-1].time_s - reqs[0].time_s), rel=0.25)
