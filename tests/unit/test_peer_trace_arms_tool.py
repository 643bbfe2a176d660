"""bench/tools/peer_trace_arms.py without servers: its --arm parsing and the count of missed requests."""

from __future__ import annotations

import argparse

import pytest

from harness.bench_tools import load_bench_tool


@pytest.fixture(scope="module")
def tool():
    return load_bench_tool("peer_trace_arms")


def test_an_arm_is_a_name_and_the_prefill_flags(tool):
    assert tool.parse_arm("auto=--disaggregation auto --prefills-ahead 1") == (
        "auto", ["--disaggregation", "auto", "--prefills-ahead", "1"])
    assert tool.parse_arm("base=") == ("base", [])  # the experiment's flags alone
    for bad in ("no-equals", "=--flag"):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME=FLAGS"):
            tool.parse_arm(bad)


def test_missed_counts_each_bound_and_lists_the_late_prompts(tool):
    rows = [{"prompt": 4096, "ok": True, "ttft_ms": 2500.0, "tbt_ms": 20.0},  # late
            {"prompt": 640, "ok": True, "ttft_ms": 2001.0, "tbt_ms": 120.0},  # late and slow
            {"prompt": 128, "ok": True, "ttft_ms": 2000.0, "tbt_ms": 100.0},  # on both bounds: met
            {"prompt": 512, "ok": False, "ttft_ms": None, "tbt_ms": None}]  # failed: neither late nor slow
    assert tool.missed(rows, 2000.0, 100.0) == {"ttft": 2, "tbt": 1, "failed": 1, "prompts_of_late": [640, 4096]}


def test_a_run_where_every_request_failed_still_prints(tool):
    r = {"goodput_rps": 0.0, "slo_attained": 0.0, "ttft_p50": None, "ttft_p99": None, "tpot_p50": None,
         "failed": 185, "requests": 185, "decisions": {}, "prefill_tokens_computed": 0.0,
         "decode_prompt_blocks": {}, "missed": {"ttft": 0, "tbt": 0, "failed": 185, "prompts_of_late": []}}
    text = tool.line("auto", r)
    assert "TTFT p50 / p99 - / - ms" in text and "failed 185/185" in text
