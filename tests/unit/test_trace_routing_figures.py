"""The trace-routing experiment's pure parts (bench/experiments/trace_routing_figures.py): arms alternate
round by round, goodput counts the requests meeting both targets per second, counters become the
figures and hit rates, ratios and verdicts against round robin say when pairs straddle the target."""

import pytest

from pdserve.bench.experiments.trace_routing_figures import (arm_order, counter_delta, pair_ratios, ratios, run_figures,
                                                              summarize_arms, verdict)
from pdserve.bench.loadgen_report import RequestResult


def test_arms_alternate_round_by_round():
    assert arm_order(["round-robin", "prefix"], 2) == [(0, "round-robin"), (0, "prefix"), (1, "round-robin"),
                                                       (1, "prefix")]
    order = arm_order(["a", "b", "c"], 3)
    assert [a for _, a in order] == ["a", "b", "c"] * 3 and [r for r, _ in order] == [0] * 3 + [1] * 3 + [2] * 3


@pytest.mark.parametrize("arms,repeats", [([], 2), (["a", "a"], 2), (["a"], 0)])
def test_bad_arm_orders_are_refused(arms, repeats):
    with pytest.raises(ValueError):
        arm_order(arms, repeats)


def _result(i, ttft, gaps, ok=True):
    r = RequestResult(i, 100, len(gaps) + 1, ok=ok, ttft=ttft if ok else None, e2e=ttft + sum(gaps) if ok else None,
                      gaps=list(gaps), chunks=len(gaps) + 1)
    return r if ok else RequestResult(i, 100, 4, error="HTTP 503")


def test_goodput_counts_requests_meeting_both_targets_per_second():
    results = [_result(0, 0.2, [0.05, 0.05]),   # meets both
               _result(1, 1.5, [0.05, 0.05]),   # TTFT too long
               _result(2, 0.3, [0.2, 0.2]),     # mean TBT too long
               _result(3, 0.9, [0.1, 0.08]),    # meets both (mean TBT 90 ms)
               _result(4, 0, [], ok=False)]     # failed
    f = run_figures(results, 2.0, {}, slo_ttft_s=1.0, slo_tbt_s=0.1)
    assert f["goodput_rps"] == pytest.approx(2 / 2.0)
    assert f["slo_attained"] == pytest.approx(2 / 5)
    assert f["failed"] == 1 and f["requests"] == 5
    assert f["ttft_p50_ms"] == pytest.approx(600.0)  # of the 4 that succeeded: 0.2 0.3 0.9 1.5
    assert len(f["ttft_s"]) == 4


def test_counters_become_the_compute_kv_and_hit_rate_figures():
    before = {"prefill0:prompt_tokens": 10.0}
    after = {"prefill0:prompt_tokens": 1010.0, "prefill0:hit_tokens": 400.0, "prefill0:computed_tokens": 600.0,
             "prefill0:kv_bytes": 1000.0,
             "prefill1:prompt_tokens": 3000.0, "prefill1:hit_tokens": 0.0, "prefill1:computed_tokens": 3000.0,
             "prefill1:kv_bytes": 3000.0,
             "decode0:hit_tokens": 128.0, "decode0:blocks_reused": 2.0, "decode0:blocks_moved": 6.0,
             "decode0:blocks_computed": 0.0, "decode1:hit_tokens": 0.0, "decode1:blocks_reused": 0.0,
             "decode1:blocks_moved": 2.0, "decode1:blocks_computed": 0.0,
             "router:prompt_blocks": 50.0, "router:hit_blocks": 5.0, "router:decisions:prefix": 3.0,
             "router:decisions:balance": 1.0}
    f = run_figures([_result(0, 0.1, [0.01])], 1.0, counter_delta(before, after), 1.0, 0.1)
    assert f["prompt_tokens"] == 4000 and f["prefill_tokens_computed"] == 3600 and f["kv_bytes_moved"] == 4000
    assert f["decode_prefix_hit_tokens"] == 128
    assert f["prefill_hit_rate"] == pytest.approx(0.1)
    assert f["prefill_hit_rates"] == {"prefill0": pytest.approx(0.4), "prefill1": 0.0}
    assert f["prefill_prompt_shares"] == {"prefill0": pytest.approx(0.25), "prefill1": pytest.approx(0.75)}
    assert f["router_hit_rate"] == pytest.approx(0.1) and f["decode_hit_rate"] == pytest.approx(0.2)
    assert f["router_decisions"] == {"prefix": 3.0, "balance": 1.0}
    empty = run_figures([_result(0, 0.1, [0.01])], 1.0, {}, 1.0, 0.1)
    assert empty["prefill_hit_rate"] is None and empty["router_hit_rate"] is None


def _run(arm, rnd, ttft_p99, computed, goodput):
    keys = ("ttft_p50_ms", "tpot_p50_ms", "tpot_p99_ms", "slo_attained", "failed", "prompt_tokens", "kv_bytes_moved",
            "decode_prefix_hit_tokens", "prefill_hit_rate", "router_hit_rate", "decode_hit_rate")
    return {"arm": arm, "round": rnd, "ttft_p99_ms": ttft_p99, "prefill_tokens_computed": computed,
            "goodput_rps": goodput, **dict.fromkeys(keys, 1.0)}


def test_medians_ratios_and_pairs_against_round_robin():
    runs = [_run("round-robin", 0, 1000.0, 1000.0, 1.0), _run("prefix", 0, 400.0, 500.0, 1.5),
            _run("round-robin", 1, 800.0, 1000.0, 1.0), _run("prefix", 1, 500.0, 700.0, 1.2)]
    summary = summarize_arms(runs, ["round-robin", "prefix"])
    assert summary["round-robin"]["ttft_p99_ms"] == 900.0 and summary["prefix"]["ttft_p99_ms"] == 450.0
    rel = ratios(summary)
    assert set(rel) == {"prefix"} and "failed" not in rel["prefix"]
    assert rel["prefix"]["ttft_p99_ms"] == pytest.approx(0.5)
    assert rel["prefix"]["prefill_tokens_computed"] == pytest.approx(0.6)
    assert rel["prefix"]["goodput_rps"] == pytest.approx(1.35)
    assert pair_ratios(runs, "prefix", "ttft_p99_ms") == [pytest.approx(0.4), pytest.approx(0.625)]
    assert ratios({"prefix": summary["prefix"]}) == {}  # no baseline: no ratios


def test_verdicts_say_when_pairs_fall_on_both_sides():
    assert verdict(0.45, [0.4, 0.48], 0.5, "lower") == "met"
    assert verdict(0.5, [0.4, 0.625], 0.5, "lower") == "met (pairs on both sides of the target)"
    assert verdict(0.9, [0.9, 0.95], 0.5, "lower") == "MISSED"
    assert verdict(1.35, [1.5, 1.2], 1.3, "higher") == "met (pairs on both sides of the target)"
    assert verdict(1.1, [], 1.3, "higher") == "MISSED"
    assert verdict(None, [], 1.3, "higher") == "no figure"
    with pytest.raises(ValueError):
        verdict(1.0, [], 1.0, "sideways")
