"""bench/tools/peer_trace_alone.py without servers: its least-squares fit and the per-system summary."""

from __future__ import annotations


import pytest

from harness.bench_tools import load_bench_tool

@pytest.fixture(scope="module")
def tool():
    return load_bench_tool("peer_trace_alone")


def test_fit_recovers_a_line(tool):
    a, b = tool.fit([0.5, 1.0, 2.0, 4.0], [0.5 * 400 + 30, 1.0 * 400 + 30, 2.0 * 400 + 30, 4.0 * 400 + 30])
    assert a == pytest.approx(400)
    assert b == pytest.approx(30)


def test_fit_of_one_x_is_flat(tool):
    assert tool.fit([1.0, 1.0], [2.0, 4.0]) == (0.0, 3.0)


def test_summary_counts_hits_and_computed_tokens(tool):
    rows = [{"prompt": 2048, "hits": 1024, "ttft": 0.512},  # 1024 computed: 500 ms per 1,000
            {"prompt": 4096, "hits": 0, "ttft": 2.048},  # 4096 computed: 500 ms per 1,000
            {"prompt": 512, "hits": 512, "ttft": 0.02}]  # all hits: not among the big ones
    s = tool.summary(rows)
    assert s["requests"] == 3 and s["prompt_tokens"] == 6656
    assert s["hit_share"] == pytest.approx(1536 / 6656)
    assert s["ttft_sum_s"] == pytest.approx(2.58)
    assert s["ttft_p50_ms"] == pytest.approx(512)
    assert s["ms_per_1k_computed_p50_of_big"] == pytest.approx(500)


def test_timeline_splits_the_engine_idle_time_by_what_waited(tool):
    # monotonic seconds from 10 (0 means "not set"): r1 allocated at once, forward pass 11.0-11.2 (two layers
    # 0.1 apart); r2 in line 10.5-11.5, forward pass 12.0-12.2
    r1 = {"arrived": 10.0, "allocated": 10.0, "layer_stored": [11.1, 11.2], "prefill_done": 11.2}
    r2 = {"arrived": 10.5, "allocated": 11.5, "layer_stored": [12.1, 12.2], "prefill_done": 12.2}
    t = tool.timeline([r1, r2])
    assert t["requests"] == 2
    assert t["computing_s"] == pytest.approx(0.4, abs=0.003)
    assert t["idle_while_allocated_waits_s"] == pytest.approx(1.5, abs=0.003)  # r1 10-11.0, r2 11.5-12.0
    assert t["idle_while_only_in_line_waits_s"] == pytest.approx(0.3, abs=0.003)  # r2 11.2-11.5


def test_timeline_skips_requests_without_a_forward_pass(tool):
    assert tool.timeline([{"arrived": 1.0, "allocated": 0.0, "layer_stored": [], "prefill_done": 0.0}]) == {}
