"""The scale experiment's report arithmetic (bench/experiments/scale_report.py): simulated-time figures from a
sped-up run, ratios over the baselines, issue 50's targets; and the sim's fidelity ratios (peer_sim.py)."""

import pytest

from pdserve.bench.experiments import peer_sim, scale_report
from pdserve.bench.experiments.scale import arm_layout, derive_profile
from pdserve.bench.loadgen_report import RequestResult


def _result(ttft: float, gap: float, tokens: int = 5) -> RequestResult:
    return RequestResult(0, 10, tokens, ok=True, ttft=ttft, e2e=ttft + gap * (tokens - 1), gaps=[gap] * (tokens - 1),
                         chunks=tokens)


def test_arm_figures_are_in_simulated_time():
    results = [_result(0.1, 0.01), _result(0.3, 0.01), _result(1.0, 0.01)]
    f = scale_report.arm_figures(results, wall_s=10.0, speedup=4.0, slo_ttft_s=2.0, slo_tbt_s=0.1)
    assert f["ttft_p50_s"] == pytest.approx(1.2)  # 0.3 wall s x 4
    assert f["tpot_p50_s"] == pytest.approx(0.04)
    assert f["sim_duration_s"] == 40.0
    # SLO 2 s simulated = 0.5 wall s: the 1.0 s request misses; 2 of 3 met over 40 simulated s
    assert f["slo_attained"] == pytest.approx(2 / 3) and f["goodput_rps"] == pytest.approx(2 / 40)
    assert f["request_rps"] == pytest.approx(3 / 40)
    with pytest.raises(ValueError):
        scale_report.arm_figures(results, 10.0, 0, 2.0, 0.1)


def _run(arm: str, ttft_p99: float, goodput: float) -> dict:
    return {"arm": arm, "ttft_p50_s": 1.0, "ttft_p99_s": ttft_p99, "tpot_p50_s": 0.01, "tpot_p99_s": 0.02,
            "goodput_rps": goodput, "slo_attained": 0.5, "failed": 0}


def test_ratios_over_baselines_and_targets():
    runs = [_run("round-robin", 10.0, 2.0), _run("prefix", 4.0, 2.8), _run("least-loaded", 12.0, 1.0)]
    compared = scale_report.compare(runs)
    assert compared["prefix"]["ttft_p99_s"] == pytest.approx(0.4) and compared["prefix"]["goodput_rps"] == 1.4
    assert compared["least-loaded"]["baseline"] == "round-robin" and "wrr" not in compared
    t = scale_report.targets(compared)
    assert t["prefix ttft_p99_s"]["verdict"] == "met" and t["prefix goodput_rps"]["verdict"] == "met"
    missed = scale_report.targets(scale_report.compare([_run("round-robin", 10.0, 2.0), _run("prefix", 6.0, 2.2)]))
    assert missed["prefix ttft_p99_s"]["verdict"] == "MISSED" and missed["prefix goodput_rps"]["verdict"] == "MISSED"
    assert scale_report.targets({})["prefix ttft_p99_s"]["verdict"] == "not run"
    text = scale_report.format_table({"plan": "p", "runs": [{**r, "decodes": 32} for r in runs],
                                      "ratios": compared, "targets": t})
    assert "prefix / round-robin" in text and "met" in text


def test_arm_layouts():
    class A:
        decodes, picker_decodes = 32, 64
    assert arm_layout(A, "prefix")[0] == 32
    assert arm_layout(A, "wrr") == (64, ["--policy", "prefix"], ["--policy", "wrr"])
    assert arm_layout(A, "rr")[2] == ["--policy", "rr"] and arm_layout(A, "round-robin")[1][-1] == "round-robin"
    with pytest.raises(ValueError, match="unknown arm"):
        arm_layout(A, "random")


def test_derived_profile_runs_faster_and_longer(tmp_path):
    from pdserve.engine.sim.profile import load_profile

    base = load_profile("h200-llama3-8b")
    p = load_profile(derive_profile("h200-llama3-8b", 4.0, 131072, tmp_path / "p.json"))
    assert p.step.prefill_s(1000) == pytest.approx(base.step.prefill_s(1000) / 4)
    assert p.step.decode_s(8, 4000) == pytest.approx(base.step.decode_s(8, 4000) / 4)
    assert p.model.context_length == 131072 and p.model.num_layers == base.model.num_layers
    assert "/ 4" in p.source


def test_fidelity_ratios_and_band():
    cells = {"c": {"medians": {"pdserve": {"ttft_p50": 1.0, "ttft_p99": 2.0, "tpot_mean": 0.1, "goodput_rps": 1.0},
                               "sim": {"ttft_p50": 1.1, "ttft_p99": 2.6, "tpot_mean": 0.09, "goodput_rps": 1.0}}}}
    runs = [{"system": s, "repeat": r, "cells": {"c": {"ttft_p50": v, "ttft_p99": 2.0, "tpot_mean": 0.1,
                                                      "goodput_rps": 1.0}}}
            for r, (a, b) in enumerate([(1.0, 1.1), (1.0, 1.3)]) for s, v in (("pdserve", a), ("sim", b))]
    out = peer_sim.compare(runs, cells)["c"]
    assert out["ttft_p50"]["ratio"] == pytest.approx(1.1) and out["ttft_p50"]["pairs"] == pytest.approx([1.1, 1.3])
    assert out["ttft_p50"]["verdict"] == "within 15% (repeats on both sides of the band)"
    assert out["ttft_p99"]["verdict"] == "OUT of 15%" and out["tpot_mean"]["verdict"].startswith("within")
    assert peer_sim.within(0.85) and not peer_sim.within(0.84) and peer_sim.within(None) is None
    assert "ttft_p99" in peer_sim.format_compare({"c": out})
