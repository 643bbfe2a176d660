"""bench/tools/trace_engine_compute.py without engines: its per-engine summary."""

from __future__ import annotations

import pytest

from harness.bench_tools import load_bench_tool


@pytest.fixture(scope="module")
def tool():
    return load_bench_tool("trace_engine_compute")


def test_summary_splits_cpu_by_prefix_hit(tool):
    rows = [{"cpu": 1.0, "prompt": 4096, "hits": 0}, {"cpu": 0.25, "prompt": 2048, "hits": 1024},
            {"cpu": 0.05, "prompt": 512, "hits": 512}]
    s = tool.summary(rows)
    assert s["cpu_s"] == pytest.approx(1.3)
    assert s["hit_share"] == pytest.approx(1536 / 6656)
    assert (s["with_hit_n"], s["no_hit_n"]) == (2, 1)
    assert s["with_hit_cpu_s"] == pytest.approx(0.3) and s["no_hit_cpu_s"] == pytest.approx(1.0)
