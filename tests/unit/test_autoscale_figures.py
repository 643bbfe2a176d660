"""Experiment 6's figures from synthetic measurements: attainment, recovery, process-seconds,
direction changes and the targets."""

from pdserve.bench.experiments.autoscale_figures import (arm_figures, attainment_over_time, direction_changes,
                                                         processes, recovery_s, targets)
from pdserve.bench.experiments.load_trace import LoadTrace

SLO = (1.0, 0.1)
TRACE = LoadTrace(rate=1, burst=4, quiet_s=10, plateau_s=20, ramp_s=10, tail_s=10)


def req(sent_at, ttft=0.2, ok=True, gap=0.01):
    return {"sent_at": sent_at, "ok": ok, "ttft": ttft, "mean_tbt": gap, "error": "" if ok else "boom"}


def test_attainment_and_recovery_after_the_burst():
    results = ([req(t) for t in range(0, 10)] + [req(t, ttft=3.0) for t in range(10, 20)]
               + [req(t) for t in range(20, 50)])
    buckets = attainment_over_time(results, SLO, 5.0, 50)
    assert [a for _, a, _ in buckets][:5] == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert recovery_s(buckets, 5.0, 10.0) == 10.0                    # good again from t=20
    assert recovery_s(attainment_over_time([req(t) for t in range(50)], SLO, 5, 50), 5, 10) == 0.0
    still_bad = [req(t) for t in range(10)] + [req(t, ttft=3.0) for t in range(10, 50)]
    assert recovery_s(attainment_over_time(still_bad, SLO, 5, 50), 5, 10) is None


def test_a_slow_token_stream_misses_the_slo_and_failures_are_split():
    run = {"results": [req(1), req(2, gap=0.5), req(3, ok=False, ttft=None), req(4, ok=False, ttft=0.3)],
           "servers": [(0.0, {"prefill": {"ready": 1}, "decode": {"ready": 2}})], "wall_s": 10.0,
           "scale_events": [], "sessions_finished_by_drained_decodes": []}
    f = arm_figures(run, TRACE, SLO, 5.0)
    assert f["slo_attainment"] == 0.25 and f["failed"] == 2 and f["cut_mid_stream"] == 1
    assert f["process_seconds"] == 30.0 and f["max_decodes"] == 2


def test_process_seconds_follow_the_processes_alive():
    samples = [(0.0, {"prefill": {"ready": 1}, "decode": {"ready": 1}}),
               (10.0, {"prefill": {"ready": 1}, "decode": {"ready": 1, "starting": 2}}),
               (20.0, {"prefill": {"ready": 1}, "decode": {"ready": 2, "draining": 1}, "router": {"ready": 1}})]
    total, timeline = processes(samples, 30.0)
    assert total == 10 * 2 + 10 * 4 + 10 * 4                          # the router is not counted
    assert timeline == [(0.0, 1, 1), (10.0, 3, 1), (20.0, 3, 2)]


def test_direction_changes_and_targets():
    events = [{"pool": "decode", "from": 1, "to": 2}, {"pool": "decode", "from": 2, "to": 3},
              {"pool": "decode", "from": 3, "to": 2}, {"pool": "decode", "from": 2, "to": 1}]
    assert direction_changes(events, "decode") == 2 and direction_changes(events, "prefill") == 0
    flappy = events + [{"pool": "decode", "from": 1, "to": 2}]
    assert direction_changes(flappy, "decode") == 3
    figures = {"autoscale": {"slo_attainment": 0.97, "cut_mid_stream": 0,
                             "direction_changes": {"decode": 2, "prefill": 0},
                             "process_seconds": 60.0},
               "over": {"process_seconds": 100.0}}
    verdict = targets(figures, TRACE)
    assert all(c["met"] for c in verdict["checks"].values())
    figures["autoscale"]["process_seconds"] = 80.0
    assert not targets(figures, TRACE)["checks"]["process_seconds_vs_over"]["met"]


def test_compact_results_keep_the_mean_and_max_gap():
    from pdserve.bench.experiments.autoscale import compact

    r = compact({"ok": True, "ttft": 0.1, "gaps": [0.01, 0.03], "error": "x" * 1000})
    assert "gaps" not in r and r["mean_tbt"] == 0.02 and r["max_tbt"] == 0.03 and len(r["error"]) == 300
