"""/metrics text -> Window: the exposition parser, histogram quantiles, and windows built from
real ServerMetrics renders (counter resets, replicas joining and leaving). The metric names the
planner reads are checked against pdserve/metrics.py, the one table of metrics."""

import math

import pytest

from pdserve.metrics import ServerMetrics, exported_series_names
from pdserve.planner import Planner, PlannerConfig, PoolLimits
from pdserve.planner.exposition import parse, total
from pdserve.planner.observe import ENGINE_BUSY, SERIES, Snapshot, histogram_quantile, window_between, window_over


def render(m: ServerMetrics) -> dict:
    return parse(m.render()[0].decode())


def test_every_series_the_planner_reads_is_exported_by_the_servers():
    assert set(SERIES) <= exported_series_names(), set(SERIES) - exported_series_names()


def test_parse_reads_labels_escapes_and_special_values():
    text = '\n'.join([
        '# HELP x help', '# TYPE x gauge',
        'x{a="1",b="q\\"uote\\\\d,\\n"} 2.5',
        'x{a="2"} NaN',
        'y 7 1700000000000',
        'z{le="+Inf"} +Inf',
    ])
    s = parse(text)
    assert s["x"][0] == ({"a": "1", "b": 'q"uote\\d,\n'}, 2.5)
    assert math.isnan(s["x"][1][1]) and s["y"] == [({}, 7.0)] and s["z"][0][1] == math.inf
    assert total(s, "x") == 2.5 and total(s, "x", a="2") == 0 and total(s, "missing") == 0


@pytest.mark.parametrize("line", ['x{a="1" 2', 'x{a=1} 2', "x", 'x{a="1"} two'])
def test_parse_names_the_bad_line(line):
    with pytest.raises(ValueError, match="metrics line 2"):
        parse("ok 1\n" + line)


def test_histogram_quantile_interpolates_within_the_bucket():
    buckets = {0.1: 10.0, 0.5: 90.0, 1.0: 100.0, math.inf: 100.0}
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 40 / 80)
    assert histogram_quantile(0.95, buckets) == pytest.approx(0.75)
    assert histogram_quantile(0.99, {1.0: 1.0, math.inf: 10.0}) == 1.0      # in +Inf: the highest finite bound
    assert histogram_quantile(0.9, {0.1: 0.0, math.inf: 0.0}) is None       # nothing observed
    with pytest.raises(ValueError, match="quantile"):
        histogram_quantile(1.5, buckets)


def _prefill(ttfts=(), tbts=(), busy=0.0, prompt=0, waiting=0):
    m = ServerMetrics("prefill")
    for x in ttfts:
        m.ttft.observe(x)
    for x in tbts:
        m.tbt.observe(x)
    m.engine_busy.inc(busy)
    m.prompt_tokens.inc(prompt)
    m.requests_waiting.set(waiting)
    return m


def _decode(used, free, running=0):
    m = ServerMetrics("decode")
    m.kv_blocks_used.set(used)
    m.kv_blocks_free.set(free)
    m.requests_running.set(running)
    return m


def test_a_window_from_two_scrapes_of_real_metrics():
    p0, p1 = _prefill(), _prefill()
    d0 = _decode(10, 90)
    before = Snapshot(100.0, {"p0": render(p0), "p1": render(p1)}, {"d0": render(d0)})
    for m in (p0, p1):
        for _ in range(10):
            m.ttft.observe(0.12)       # in the 0.1 .. 0.15 bucket
        m.ttft.observe(4.0)            # one slow request each
        m.tbt.observe(0.02)
        m.engine_busy.inc(2.0)
        m.prompt_tokens.inc(500)
    p0.requests_waiting.set(6)
    d0.kv_blocks_used.set(60), d0.kv_blocks_free.set(40), d0.requests_running.set(3)
    after = Snapshot(110.0, {"p0": render(p0), "p1": render(p1)}, {"d0": render(d0)})
    w = window_between(before, after, quantile=0.5)
    assert w.duration_s == 10 and w.requests == 22
    assert 0.1 < w.ttft_s <= 0.15 and 0.01 < w.tbt_s <= 0.025
    assert w.prefill.replicas == 2 and w.prefill.busy == pytest.approx(4.0 / 10 / 2)
    assert w.prefill.tokens_per_s == pytest.approx(100.0)
    assert w.prefill.waiting == 6 and w.prefill.waiting_growth_per_s == pytest.approx(0.6)
    assert w.decode.kv_utilisation == pytest.approx(0.6) and w.decode.running == 3
    assert window_between(before, after, quantile=0.99).ttft_s > 2.5   # the slow ones are in the tail


def test_a_restarted_replica_counts_from_zero_and_a_new_one_is_left_out_of_rates():
    old = _prefill(ttfts=[0.1] * 50, busy=30.0, prompt=9000)
    before = Snapshot(0.0, {"p0": render(old)}, {"d0": render(_decode(0, 100))})
    restarted = _prefill(ttfts=[0.3] * 5, busy=1.0, prompt=100)       # its counters went down: a reset
    joined = _prefill(ttfts=[9.0] * 100, busy=50.0, prompt=10 ** 6)   # not in the first snapshot
    after = Snapshot(5.0, {"p0": render(restarted), "p1": render(joined)}, {})
    w = window_between(before, after)
    assert w.requests == 5 and 0.25 < w.ttft_s <= 0.3
    assert w.prefill.tokens_per_s == pytest.approx(20.0) and w.prefill.busy == pytest.approx(1.0 / 5)
    assert w.prefill.replicas == 2                       # both report now
    assert w.decode.replicas == 0 and w.decode.kv_utilisation is None


def test_snapshots_out_of_order_are_refused():
    with pytest.raises(ValueError, match="time order"):
        window_between(Snapshot(5.0), Snapshot(5.0))


def test_gauges_are_averaged_over_the_window_and_the_queue_is_read_at_its_end():
    d, p = _decode(0, 100), _prefill()
    snaps = []
    for t, used, waiting in ((0.0, 90, 9), (1.0, 0, 0), (2.0, 100, 0), (3.0, 50, 3)):   # a jumpy KV gauge
        d.kv_blocks_used.set(used), d.kv_blocks_free.set(100 - used), p.requests_waiting.set(waiting)
        snaps.append(Snapshot(t, {"p0": render(p)}, {"d0": render(d)}))
    w = window_over(snaps)
    assert w.decode.kv_utilisation == pytest.approx(0.5)             # mean of 0, 1, 0.5: the start point is left out
    assert w.prefill.waiting == 3 and w.prefill.waiting_growth_per_s == pytest.approx(-2.0)
    assert window_between(snaps[0], snaps[-1]).decode.kv_utilisation == pytest.approx(0.5)
    with pytest.raises(ValueError, match="at least 2"):
        window_over(snaps[:1])
    with pytest.raises(ValueError, match="time order"):
        window_over([snaps[1], snaps[0], snaps[2]])


def test_busy_is_the_engines_own_time_not_the_requests_overlapping_compute_intervals():
    # three prompts batched in the same steps: each request's compute interval spans the shared steps (3.5 s
    # each, 10.5 s summed in a 4 s window), while the engine ran steps for 2.2 s of the window
    p = _prefill()
    before = Snapshot(0.0, {"p0": render(p)}, {})
    for _ in range(3):
        p.prefill_compute.observe(3.5)
    p.engine_busy.inc(2.2)
    w = window_between(before, Snapshot(4.0, {"p0": render(p)}, {}))
    assert w.prefill.busy == pytest.approx(2.2 / 4)


def test_a_prefill_that_does_not_report_its_busy_time_is_left_out_of_busy():
    busy, silent = _prefill(), _prefill()

    def snap(at):
        quiet = render(silent)
        quiet.pop(ENGINE_BUSY)   # a server that does not export the series (not this version's)
        return Snapshot(at, {"p0": render(busy), "p1": quiet}, {})

    before = snap(0.0)
    busy.engine_busy.inc(3.0)
    w = window_between(before, snap(5.0))
    assert w.prefill.replicas == 2 and w.prefill.busy == pytest.approx(3.0 / 5)   # p0's alone
    only_silent = {"p1": snap(0.0).prefill["p1"]}
    assert window_between(Snapshot(0.0, only_silent), Snapshot(1.0, only_silent)).prefill.busy is None


@pytest.mark.parametrize("engine_busy_s, desired, signal", [(2.2, 1, "steady"), (3.8, 2, "busy")])
def test_the_planners_prefill_decision_follows_the_engines_busy_time(engine_busy_s, desired, signal):
    # the compressed day's first decision (docs/benchmarks.md): one prefill, three prompts in flight together,
    # their compute intervals summing to 2.6x the 4 s window. Decided on the engine's own busy time: 0.55 of
    # the window holds one prefill (target 0.7), 0.95 calls for a second; the intervals would have asked for 2
    # either way.
    p, d = _prefill(), _decode(20, 80, running=3)
    snaps = [Snapshot(0.0, {"p0": render(p)}, {"d0": render(d)})]
    for t in (1.0, 2.0, 3.0, 4.0):
        for _ in range(3):
            p.prefill_compute.observe(3.5 / 4)
            p.ttft.observe(0.3)
        p.engine_busy.inc(engine_busy_s / 4)
        snaps.append(Snapshot(t, {"p0": render(p)}, {"d0": render(d)}))
    window = window_over(snaps)
    assert window.prefill.busy == pytest.approx(engine_busy_s / 4)
    planner = Planner(PlannerConfig(prefill=PoolLimits(1, 6), decode=PoolLimits(1, 2)))
    decision = planner.decide(window, {"prefill": 1, "decode": 1}).prefill
    assert (decision.desired, decision.signal) == (desired, signal), decision.describe()
    assert f"busy {engine_busy_s / 4:.2f}" in decision.reason
