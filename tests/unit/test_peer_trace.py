"""The peer experiment's trace cell (bench/experiments/peer_trace.py) without vLLM or servers: the grid's
and the trace's options exclude each other, both systems get the very same scaled requests with the
trace's block structure, and goodput, its ratio and the verdict come out of per-request results."""

import argparse
import json

import pytest

from pdserve.bench.experiments import peer, peer_trace
from pdserve.bench.experiments.peer_report import aggregate, goodput_verdict, run_figures
from pdserve.bench.loadgen_report import RequestResult, summarize

POOL = list(range(1, 500))
BLOCK = 64  # tokens of a hash id at --length-scale 0.125


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    peer.add_arguments(parser)
    return parser.parse_args(list(argv))


def _resolved(*argv: str) -> argparse.Namespace:
    args = _parse(*argv)
    peer._validate(args)
    return args


@pytest.fixture
def trace(tmp_path):
    """A Mooncake trace of 3 requests over 100 s: the second repeats the first's 2 blocks and adds one."""
    rows = [(0, 1024, 200, [7, 8]), (50_000, 1536, 100, [7, 8, 9]), (100_000, 512, 64, [3])]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": ids}) + "\n"
                            for t, n, o, ids in rows))
    return path


def test_grid_options_beside_trace_are_an_error_naming_them(trace):
    with pytest.raises(ValueError, match="--trace replaces the grid: drop --rates, --num-requests"):
        _resolved("--trace", str(trace), "--rates", "1", "--num-requests", "5")
    with pytest.raises(ValueError, match="--sample, --slo-ttft-ms: options of --trace"):
        _resolved("--sample", "0.5", "--slo-ttft-ms", "500")
    with pytest.raises(ValueError, match="--trace .*nope.jsonl: no such file"):
        _resolved("--trace", str(trace.with_name("nope.jsonl")))
    with pytest.raises(ValueError, match="--slo-tbt-ms must be > 0"):
        _resolved("--trace", str(trace), "--slo-tbt-ms", "0")
    with pytest.raises(ValueError, match="--kv-tokens must hold"):
        _resolved("--trace", str(trace), "--kv-tokens", "1000")
    help_text = argparse.ArgumentParser()
    peer.add_arguments(help_text)
    assert "the grid's options are then an error" in " ".join(help_text.format_help().split())


def test_each_workload_gets_its_own_defaults_and_the_grid_is_unchanged(trace):
    grid = _resolved()
    assert (grid.prompt_lens, grid.output_lens, grid.rates, grid.load_fractions, grid.num_requests) == (
        [512, 2048], [64, 256], None, [0.5, 0.9], 50)
    assert (grid.model_size, grid.name, grid.trace) == ("peer", "peer", None)
    assert not hasattr(grid, "duration")  # no trace option in a grid run's parameters
    t = _resolved("--trace", str(trace))
    assert (t.model_size, t.name, t.duration, t.length_scale, t.slo_ttft_ms, t.slo_tbt_ms) == (
        "small", "peer-trace", 120.0, 0.125, 2000.0, 100.0)
    assert not hasattr(t, "prompt_lens")
    t = _resolved("--trace", str(trace), "--model-size", "tiny", "--name", "x", "--duration", "30")
    assert (t.model_size, t.name, t.duration) == ("tiny", "x", 30.0)
    assert peer_trace.max_len(t) == 4096 + 32 + 64


def test_the_trace_cell_keeps_the_block_structure_and_scales_time(trace):
    args = _resolved("--trace", str(trace), "--sample", "1", "--duration", "20")
    work = peer_trace.workload(args, POOL)
    assert [s.prompt_tokens for s in work.specs] == [128, 192, 64]  # lengths x1/8
    assert [s.output_tokens for s in work.specs] == [25, 12, 8]
    assert work.arrivals == pytest.approx([0.0, 10.0, 20.0])  # 100 trace seconds over --duration 20
    a, b, c = (s.prompt_ids for s in work.specs)
    assert b[:2 * BLOCK] == a  # ids 7, 8: the same two token blocks
    assert b[2 * BLOCK:] != a[:BLOCK] and c != a[:BLOCK]  # ids 9 and 3: blocks of their own
    line = peer_trace.describe(args, work)
    assert str(trace) in line and "time x0.2" in line and "lengths x0.125" in line and "from 0s" in line
    assert peer_trace.workload(args, POOL) == work  # rebuilt the same (same seed)
    windowed = peer_trace.workload(_resolved("--trace", str(trace), "--sample", "1", "--window-start", "40",
                                             "--window", "30"), POOL)
    assert len(windowed.specs) == 1 and windowed.specs[0] == work.specs[1]


def _result(i: int, ttft: float, gap: float, ok: bool = True) -> RequestResult:
    if not ok:
        return RequestResult(i, 64, 4, error="HTTP 503: busy")
    return RequestResult(i, 64, 4, ok=True, ttft=ttft, e2e=ttft + 3 * gap, gaps=[gap] * 3, chunks=4)


def test_both_systems_get_the_same_requests_at_the_same_times(trace, monkeypatch):
    args = _resolved("--trace", str(trace), "--sample", "1", "--warmup", "2")
    work = peer_trace.workload(args, POOL)
    calls = []

    def fake_send(url, specs, arrivals=None, concurrency=None, timeout=0.0):
        calls.append((url, specs, arrivals, concurrency))
        return [_result(i, 0.1, 0.01) for i in range(len(specs))], 10.0

    monkeypatch.setattr(peer_trace, "send", fake_send)
    cells = {url: peer_trace.run_trace(url, work, POOL, args, say=lambda _: None) for url in ("pd", "vllm")}
    (_, warm_a, _, conc), (_, replay_a, times_a, _), (_, warm_b, _, _), (_, replay_b, times_b, _) = calls
    assert replay_a == replay_b == work.specs and times_a == times_b == work.arrivals
    assert warm_a == warm_b and len(warm_a) == 2 and conc == 1
    assert warm_a[0].prompt_tokens == 128  # the trace's median prompt, random tokens: no block of the trace
    assert not any(w.prompt_ids[:BLOCK] == s.prompt_ids[:BLOCK] for w in warm_a for s in work.specs)
    f = cells["pd"][peer_trace.TRACE_CELL]
    assert f["goodput_rps"] == pytest.approx(0.3) and f["slo"] == {"ttft_s": 2.0, "tbt_s": 0.1}


def _run(system: str, repeat: int, results: list[RequestResult], wall: float = 10.0) -> dict:
    figures = run_figures(summarize(results, wall, 1.0, 0.05), results)
    return {"system": system, "repeat": repeat, "cells": {peer_trace.TRACE_CELL: figures}}


def test_goodput_counts_requests_meeting_both_bounds_and_judges_the_target():
    pd = [_result(0, 0.5, 0.02), _result(1, 0.9, 0.04), _result(2, 1.5, 0.02),  # TTFT over 1 s
          _result(3, 0.2, 0.08), _result(4, 0.3, 0.03, ok=False)]  # TBT over 50 ms; failed
    vllm = [_result(0, 0.5, 0.02), _result(1, 1.2, 0.02), _result(2, 0.8, 0.06), _result(3, 0.4, 0.01)]
    runs = [_run("pdserve", 0, pd), _run("vllm", 0, vllm), _run("pdserve", 1, pd), _run("vllm", 1, vllm)]
    cells = aggregate(runs)
    m = cells[peer_trace.TRACE_CELL]["medians"]
    assert m["pdserve"]["goodput_rps"] == pytest.approx(0.2) and m["vllm"]["goodput_rps"] == pytest.approx(0.2)
    assert m["pdserve"]["slo_attained"] == pytest.approx(2 / 5) and m["vllm"]["slo_attained"] == pytest.approx(2 / 4)
    v = goodput_verdict(runs, cells, peer_trace.TRACE_CELL)
    assert v["ratio"] == pytest.approx(1.0) and v["verdict"] == "met" and v["ratios_per_repeat"] == [1.0, 1.0]
    ttft_pd = (0.5 + 0.9 + 1.5 + 0.2) / 4
    ttft_vllm = (0.5 + 1.2 + 0.8 + 0.4) / 4
    assert v["ttft_tpot_ratios"]["ttft_mean"] == pytest.approx(ttft_pd / ttft_vllm)
    assert v["ttft_tpot_ratios"]["tpot_mean"] == pytest.approx((0.16 / 4) / (0.11 / 4))

    worse = [_result(0, 0.5, 0.02)] + [_result(i, 3.0, 0.02) for i in range(1, 5)]  # 1 of 5 meets the SLO
    runs[2] = _run("pdserve", 1, worse)
    v = goodput_verdict(runs, aggregate(runs), peer_trace.TRACE_CELL)
    assert v["ratio"] == pytest.approx(0.15 / 0.2) and v["ratios_per_repeat"] == [1.0, 0.5]
    assert v["verdict"] == "MISSED (pairs on both sides of the target)"


def test_goodput_verdict_without_a_vllm_goodput_and_without_an_slo():
    none_met = [_result(0, 5.0, 0.02)]
    runs = [_run("pdserve", 0, [_result(0, 0.5, 0.02)]), _run("vllm", 0, none_met)]
    v = goodput_verdict(runs, aggregate(runs), peer_trace.TRACE_CELL)
    assert v["ratio"] is None and v["verdict"] == "met (vLLM P/D's goodput is 0)"
    runs[0] = _run("pdserve", 0, none_met)
    assert goodput_verdict(runs, aggregate(runs), peer_trace.TRACE_CELL)["verdict"].startswith("no request met")
    grid = run_figures(summarize(none_met, 1.0), none_met)  # a grid cell: no SLO, no goodput
    assert "goodput_rps" not in grid
    cells = aggregate([{"system": s, "repeat": 0, "cells": {"p64-o8-r1": grid}} for s in ("pdserve", "vllm")])
    assert "goodput_rps" not in cells["p64-o8-r1"]["ratios"]
    assert "no figure" in goodput_verdict([], cells, "p64-o8-r1")["verdict"]


def test_the_report_names_the_trace_its_scaling_and_the_slo(trace):
    args = _resolved("--trace", str(trace), "--sample", "1", "--duration", "20")
    work = peer_trace.workload(args, POOL)
    runs = [_run("pdserve", 0, [_result(0, 0.5, 0.02)]), _run("vllm", 0, [_result(0, 0.5, 0.02), _result(1, 3, 0)])]
    doc, text = peer_trace.results(args, work, runs, aggregate(runs))
    assert doc["workload"] == peer_trace.describe(args, work) and doc["slo"] == "TTFT <= 2000 ms, mean TBT <= 100 ms"
    first, goodput, ratios = text.splitlines()
    assert first == f"workload: {doc['workload']}"
    assert "pdserve 0.10 req/s, vLLM P/D 0.10 req/s" in goodput and "met" in goodput and "TTFT mean" in ratios
    assert json.loads(json.dumps(doc)) == doc


def test_pdserve_queue_policy_declares_goodputs_slo_to_pdserves_prefill(trace):
    assert peer_trace.pdserve_slo_flags(_resolved("--trace", str(trace))) == []  # fifo: nothing declared
    assert peer_trace.pdserve_slo_flags(_resolved()) == []  # the grid has no SLO
    args = _resolved("--trace", str(trace), "--pdserve-queue-policy", "qlm", "--slo-ttft-ms", "1500", "--sample", "1")
    flags = peer_trace.pdserve_slo_flags(args)
    assert flags[:3] == ["--queue-policy", "qlm", "--slo-classes"]
    from pdserve.slo import parse  # the prefill's own parser takes what the flags declare
    declared = parse(json.loads(flags[3])).default
    assert (declared.ttft_ms, declared.tbt_ms) == (1500, 100)
    with pytest.raises(ValueError, match="--slo-ttft-ms must be whole milliseconds with --pdserve-queue-policy"):
        _resolved("--trace", str(trace), "--pdserve-queue-policy", "edf", "--slo-ttft-ms", "1500.5")
    with pytest.raises(ValueError, match="--pdserve-queue-policy: options of --trace"):
        _resolved("--pdserve-queue-policy", "qlm")
    assert "prefill --queue-policy qlm --slo-classes" in peer._plan(
        args, "m", "python", 4192, None, peer_trace.workload(args, POOL))
