"""The SLO planner's compressed-day arms (bench/experiments/scale_day.py): the sizings from the profile, each arm's
pool bounds, pod-seconds from servers.json samples, the per-request SLO figures, the verdict, and the
``pdserve up`` command line each arm runs (parsed by up's own parser and planner config)."""

import argparse
import math
from pathlib import Path

import pytest

from pdserve.bench.experiments import scale, scale_day
from pdserve.bench.experiments.scale_day import (Pools, RequestCost, arm_bounds, day_figures, day_sizing, pod_seconds,
                                                 pools_for, request_cost, slo_held, timeline, up_argv, verdict)
from pdserve.bench.experiments.scale_workload import BLOCK, served_by_one_cache
from pdserve.bench.trace_replay import TraceRequest
from pdserve.defaults import BLOCK_SIZE
from pdserve.engine.sim.profile import StepTime, load_profile
from pdserve.localcluster import autoscale as local_autoscale
from pdserve.localcluster import up_args

STEP = StepTime(base_s=0.01, prefill_token_s=1e-4, prefill_pair_s=0.0, decode_seq_s=0.001,
                decode_context_token_s=1e-6)


def test_served_by_one_cache_counts_each_requests_cached_leading_blocks():
    reqs = [TraceRequest(0, 2 * BLOCK, 1, (0, 1)), TraceRequest(1, 3 * BLOCK, 1, (0, 1, 2)),
            TraceRequest(2, 2 * BLOCK, 1, (0, 1))]
    assert served_by_one_cache(reqs) == [0, 2 * BLOCK, 2 * BLOCK - 1]  # never the last token
    assert served_by_one_cache(reqs, 2) == [0, 0, 2 * BLOCK - 1]  # the second on an empty cache
    with pytest.raises(ValueError, match="cache"):
        served_by_one_cache(reqs, 0)


def test_request_cost_charges_uncached_tokens_in_chunks():
    reqs = [TraceRequest(0, 2 * BLOCK, 10, (0, 1)), TraceRequest(1, 3 * BLOCK, 30, (0, 1, 2))]
    c = request_cost(reqs, STEP, chunk_tokens=BLOCK)
    # first: 1024 new tokens in 2 chunks; second: 512 new (1024 cached) in 1 chunk
    assert c.prefill_busy_s == pytest.approx(((2 * BLOCK * 1e-4 + 2 * 0.01) + (BLOCK * 1e-4 + 0.01)) / 2)
    assert c.output_tokens == 20 and c.kv_tokens == (2 * BLOCK + 10 + 3 * BLOCK + 30) / 2
    assert c.decode_context == pytest.approx((2 * BLOCK + 5 + 3 * BLOCK + 15) / 2)
    with pytest.raises(ValueError):
        request_cost([], STEP, 8)
    with pytest.raises(ValueError):
        request_cost(reqs, STEP, 0)


def test_pools_for_sizes_prefill_by_busy_and_decode_by_littles_law():
    cost = RequestCost(prefill_busy_s=0.35, output_tokens=300, decode_context=10_000, kv_tokens=10_300)
    p = pools_for(4.0, cost, STEP, num_blocks=13_000, tbt_target_s=0.1)
    assert p.prefills == math.ceil(4.0 * 0.35 / 0.7) == 2
    k = STEP.decode_seq_s + STEP.decode_context_token_s * 10_000  # 11 ms a row
    left = 1 - 4.0 * 300 * k / p.decodes
    in_flight = 4.0 * 300 * STEP.base_s / left
    assert left > 0 and in_flight * 10_300 <= p.decodes * 13_000 * BLOCK_SIZE * 0.7
    assert STEP.base_s + in_flight / p.decodes * k <= 0.1
    if p.decodes > 1:  # one fewer would not do
        fewer = p.decodes - 1
        left = 1 - 4.0 * 300 * k / fewer
        assert left <= 0 or (4.0 * 300 * STEP.base_s / left) / fewer * k + STEP.base_s > 0.1 or \
            (4.0 * 300 * STEP.base_s / left) * 10_300 > fewer * 13_000 * BLOCK_SIZE * 0.7
    # more load never needs fewer pods; no load needs one of each
    sizes = [pools_for(r, cost, STEP, 13_000, 0.1) for r in (0.0, 1.0, 2.0, 4.0, 8.0, 16.0)]
    assert sizes[0] == Pools(1, 1)
    assert all(a.prefills <= b.prefills and a.decodes <= b.decodes for a, b in zip(sizes, sizes[1:]))
    assert sizes[-1].decodes > 1  # 16 req/s of 300 tokens at 11 ms a row: one decode cannot keep up
    small_kv = pools_for(4.0, cost, STEP, num_blocks=300, tbt_target_s=10.0)  # KV, not TBT, binds
    assert small_kv.decodes > p.decodes
    with pytest.raises(ValueError, match="decodes"):
        pools_for(1e6, cost, STEP, 13_000, 0.1, max_decodes=4)
    with pytest.raises(ValueError):
        pools_for(-1.0, cost, STEP, 13_000, 0.1)


def _day() -> list[TraceRequest]:
    """A day of 100 s: 1 req/s in the first half, 3 req/s in the second."""
    times = [i * 1.0 for i in range(50)] + [50 + i / 3 for i in range(150)]
    return [TraceRequest(t, 2 * BLOCK, 100, (i, i + 100_000)) for i, t in enumerate(times)]


def test_day_sizing_takes_trough_mean_and_peak_from_the_days_bins():
    s = day_sizing(_day(), day_s=100.0, bins=4, step=STEP, chunk_tokens=8192, num_blocks=13_000, tbt_target_s=0.1)
    assert s["rates_rps"] == pytest.approx({"trough": 1.0, "mean": 2.0, "peak": 3.0})
    pools = s["_pools"]
    assert pools["trough"].pods <= pools["mean"].pods <= pools["peak"].pods
    assert s["pools"]["peak"] == {"prefills": pools["peak"].prefills, "decodes": pools["peak"].decodes}
    busy = s["cost"]["prefill_busy_s"]  # no reuse in this day: the whole prompt, one chunk
    assert busy == pytest.approx(2 * BLOCK * 1e-4 + 0.01)
    assert pools["peak"].prefills == math.ceil(3.0 * busy / 0.7)


def test_arm_bounds_planner_starts_at_the_trough_and_may_pass_the_peak():
    pools = {"trough": Pools(1, 1), "mean": Pools(2, 1), "peak": Pools(3, 2)}
    assert arm_bounds("day-planner", pools, 2.0) == {"prefill": (1, 1, 6), "decode": (1, 1, 4)}
    assert arm_bounds("day-planner", pools, 1.0) == {"prefill": (1, 1, 4), "decode": (1, 1, 3)}  # at least peak + 1
    assert arm_bounds("day-peak", pools, 2.0) == {"prefill": (3, 3, 3), "decode": (2, 2, 2)}
    assert arm_bounds("day-mean", pools, 2.0) == {"prefill": (2, 2, 2), "decode": (1, 1, 1)}
    with pytest.raises(ValueError, match="day arm"):
        arm_bounds("day-noon", pools, 2.0)


def test_pod_seconds_integrates_running_processes_between_samples():
    samples = [(0.2, {"prefill": {"ready": 1}, "decode": {"ready": 1}, "router": {"ready": 1}}),
               (10.0, {"prefill": {"ready": 1, "starting": 1}, "decode": {"ready": 1}}),
               (20.0, {"prefill": {"ready": 1, "draining": 1, "gone": 3}, "decode": {"ready": 1, "exited": 1}}),
               (30.0, {"prefill": {"ready": 1}, "decode": {"ready": 1}})]
    p = pod_seconds(samples, end_s=40.0)
    assert p["prefill"] == pytest.approx(10 * 1 + 10 * 2 + 10 * 2 + 10 * 1)  # the first from 0, the last to the end
    assert p["decode"] == pytest.approx(40.0)  # exited is not running; the router is not counted
    assert p["total"] == pytest.approx(p["prefill"] + p["decode"])
    assert pod_seconds(samples, end_s=15.0)["prefill"] == pytest.approx(10 + 5 * 2)
    assert pod_seconds([], 10.0)["total"] == 0


def _result(sent: float, ttft: float | None, tbt: float, ok: bool = True, max_tbt: float | None = None) -> dict:
    return {"sent_at": sent, "ok": ok, "ttft": ttft, "mean_tbt": tbt, "max_tbt": tbt if max_tbt is None else max_tbt}


def test_day_figures_count_ttft_tbt_and_both_in_simulated_time():
    rows = [_result(0, 0.5, 0.02), _result(1, 1.5, 0.02), _result(2, 0.5, 0.08), _result(3, None, 0.0, ok=False)]
    f = day_figures(rows, wall_s=10.0, speedup=2.0, slo_ttft_s=2.0, slo_tbt_s=0.1)  # wall x 2 = simulated
    assert f["requests"] == 4 and f["failed"] == 1
    assert f["ttft_attained"] == 0.5 and f["tbt_attained"] == 0.5 and f["slo_attained"] == 0.25
    assert f["goodput_rps"] == pytest.approx(1 / 20) and f["sim_duration_s"] == 20.0
    assert f["ttft_p90_s"] == pytest.approx(3.0)


def test_timeline_bins_requests_by_send_time_with_pods_and_attainment():
    rows = [_result(1, 0.5, 0.02), _result(2, 5.0, 0.02), _result(12, 0.5, 0.02)]
    samples = [(0.0, {"prefill": {"ready": 1}, "decode": {"ready": 1}}),
               (11.0, {"prefill": {"ready": 2}, "decode": {"ready": 1}}),
               (15.0, {"prefill": {"ready": 3}, "decode": {"ready": 1}})]
    t = timeline(rows, samples, day_wall_s=20.0, bins=2, slo_ttft_s=2.0, slo_tbt_s=0.1)
    assert [r["rps"] for r in t] == [0.2, 0.1]
    assert [r["slo_attained"] for r in t] == [0.5, 1.0]
    assert [r["prefills"] for r in t] == [1.0, 2.5] and [r["decodes"] for r in t] == [1.0, 1.0]


def _run(arm: str, pods: float, met: float, ttft90: float, tbt90: float) -> dict:
    return {"arm": arm, "pod_seconds": {"total": pods}, "slo_attained": met, "goodput_rps": met,
            "ttft_p90_s": ttft90, "tbt_p90_s": tbt90}


def test_verdict_compares_the_planner_with_peak_and_mean_sizing():
    runs = [_run("day-planner", 600, 0.95, 1.5, 0.05), _run("day-peak", 1000, 0.97, 1.0, 0.04),
            _run("day-mean", 700, 0.80, 4.0, 0.05)]
    v = verdict(runs, 2.0, 0.1)
    assert v["target"] == {"planner_held_slo": True, "fewer_pod_seconds_than_peak": True, "verdict": "met"}
    assert v["planner / peak"]["pod_seconds"] == pytest.approx(0.6)
    assert v["planner / peak"]["slo_attained"] == pytest.approx(-0.02)
    assert v["planner / mean"]["goodput_rps"] == pytest.approx(0.95 / 0.80)
    assert verdict(runs[1:], 2.0, 0.1) == {}
    assert slo_held(runs[0], 2.0, 0.1) and not slo_held(runs[2], 2.0, 0.1)
    assert not slo_held({"ttft_p90_s": None, "tbt_p90_s": 0.01}, 2.0, 0.1)
    late = [_run("day-planner", 600, 0.90, 2.5, 0.05), runs[1]]  # fewer pod-seconds, but the SLO not held
    assert verdict(late, 2.0, 0.1)["target"]["verdict"] == "MISSED"
    dear = [_run("day-planner", 1200, 0.97, 1.5, 0.05), runs[1]]  # held, at more pod-seconds than peak
    assert verdict(dear, 2.0, 0.1)["target"] == {"planner_held_slo": True, "fewer_pod_seconds_than_peak": False,
                                                  "verdict": "MISSED"}


def _scale_args(**over) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    scale.add_arguments(parser)
    args = parser.parse_args([])
    for k, v in over.items():
        setattr(args, k, v)
    return args


def test_up_argv_is_a_command_pdserve_up_accepts_with_the_arms_bounds_and_slo(tmp_path):
    args = _scale_args(speedup=2.0)
    bounds = arm_bounds("day-planner", {"trough": Pools(1, 1), "mean": Pools(2, 1), "peak": Pools(3, 2)}, 2.0)
    argv = up_argv(args, "day-planner", bounds, Path("/p.json"), 131072, 8000, 8001, tmp_path)
    assert argv[0] == "up"
    parser = argparse.ArgumentParser()
    up_args.add_arguments(parser)
    up = parser.parse_args(argv[1:])
    assert (up.engine, up.sim_profile, up.model, up.prefill, up.decode) == ("sim", "/p.json", "tiny", 1, 1)
    assert up.autoscale and (up.min_prefill, up.max_prefill, up.min_decode, up.max_decode) == (1, 6, 1, 4)
    cfg = local_autoscale.planner_config(up)  # the planner takes these flags as they are
    assert cfg.ttft_target_s == pytest.approx(args.slo_ttft_ms / 1000 / 2.0)  # the servers' clock is the wall
    assert cfg.tbt_target_s == pytest.approx(args.slo_tbt_ms / 1000 / 2.0)
    assert cfg.down_stabilisation_s == args.scale_down_window and cfg.cooldown_s == args.cooldown
    assert "--sim-kv-scale 1024" in up.extra and "--max-model-len 131072" in up.extra
    assert f"--sim-link-gbps {args.link_gbps * 2:g}" in up.prefill_extra
    fixed = up_argv(args, "day-peak", arm_bounds("day-peak", {"peak": Pools(3, 2)}, 2.0), Path("/p.json"), 4096,
                    8000, 8001, tmp_path)
    up = parser.parse_args(fixed[1:])
    assert (up.prefill, up.min_prefill, up.max_prefill, up.decode, up.min_decode, up.max_decode) == (3, 3, 3, 2, 2, 2)


def test_the_scale_experiment_takes_the_day_arms_and_plans_them_on_the_shipped_profile(capsys):
    assert set(scale_day.DAY_ARMS) <= set(scale.ALL_ARMS)
    args = _scale_args(arms="day-planner,day-peak,day-mean", day_s=240.0, peak_to_trough=3.0, dry_run=True,
                       max_requests=2000)
    assert scale.run(args) == 0
    plan = capsys.readouterr().out
    assert "the day:" in plan and "peak" in plan and "mean" in plan
    load_profile(args.profile)  # the shipped profile the sizing used


def test_the_day_figure_draws_the_day_arms_and_nothing_without_them(tmp_path):
    from pdserve.bench.experiments import scale_day_figure

    line = [{"from_s": 0.0, "rps": 1.0, "slo_attained": 1.0}, {"from_s": 10.0, "rps": 3.0, "slo_attained": 0.5}]
    runs = [{"arm": arm, "timeline": line, "pods_over_time": [(0.0, 1, 1), (12.0, n, 1)],
             "pod_seconds": {"total": 10.0 * n}} for arm, n in (("day-planner", 2), ("day-peak", 3))]
    path = scale_day_figure.plot(runs + [{"arm": "prefix"}], tmp_path / "day.png", speedup=1.0)
    assert path == tmp_path / "day.png" and path.stat().st_size > 10_000
    assert scale_day_figure.plot([{"arm": "prefix"}], tmp_path / "none.png", 1.0) is None
    assert not (tmp_path / "none.png").exists()
