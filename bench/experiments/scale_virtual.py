"""The scale experiment's arms on the virtual clock (``--clock virtual``), and their fidelity to the process
cluster (``--clock both``).

``run_arm`` serves one arm's requests on a fresh ``VirtualCluster`` (``virtual_cluster.py``: the real router,
sim engines, BlockManagers, decode picker and link model, time advanced by events) with the arm's router policy
and decode picker (``trace_routing.ARMS``, ``scale.PICKER_ARMS``), the cluster flags of the process run
(``--num-blocks``, ``--max-num-batched-tokens``, ``--link-gbps``, ``--link-latency-us``) and the un-sped profile
(simulated seconds are the clock's own, so ``--speedup`` does not apply). Figures are ``scale_report``'s (the
same summary of the same client-side results), plus what only a simulation can see: each prefill's and decode's
busy share, the prompt tokens the prefills' caches served, and how long the simulation took.

``fidelity(wall_runs, virtual_runs)``: per arm and figure, virtual / wall, the drift of the virtual clock from
the process cluster on the same requests (the process cluster's error included: its servers' Python time,
and the box's load, which this records beside it).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

from pdserve.engine.sim.profile import SimProfile

from . import report, scale_report
from .virtual_clock import VRequest
from .virtual_cluster import LOAD_WEIGHT, ClusterSpec, VirtualCluster

FIDELITY_FIGURES = ("ttft_p50_s", "ttft_p99_s", "ttft_mean_s", "tpot_p50_s", "tpot_p99_s", "goodput_rps",
                    "slo_attained")


def router_settings(flags: list[str]) -> tuple[str, float]:
    """(policy, load weight) from an arm's ``pdserve router`` flags."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--policy", default="prefix")
    parser.add_argument("--load-weight", type=float, default=LOAD_WEIGHT)
    parsed = parser.parse_args(flags)
    return parsed.policy, parsed.load_weight


def cluster_spec(args, arm: str, n_decodes: int, router_flags: list[str], picker_flags: list[str],
                 max_len: int) -> ClusterSpec:
    policy, weight = router_settings(router_flags)
    return ClusterSpec(prefills=args.prefills, decodes=n_decodes, num_blocks=args.num_blocks,
                       max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_len,
                       link_gbps=args.link_gbps, link_latency_us=args.link_latency_us, policy=policy,
                       load_weight=weight, picker=picker_flags[-1])


def requests_of(specs, arrivals: list[float]) -> list[VRequest]:
    return [VRequest(i, a, s.prompt_ids, s.prompt_tokens, s.output_tokens)
            for i, (s, a) in enumerate(zip(specs, arrivals))]


def run_arm(args, arm: str, layout, profile: SimProfile, specs, arrivals: list[float], max_len: int) -> dict:
    """One arm on a fresh virtual cluster; ``layout``: (decodes, router flags, picker flags) (``scale.arm_layout``)."""
    n_decodes, router_flags, picker_flags = layout
    spec = cluster_spec(args, arm, n_decodes, router_flags, picker_flags, max_len)
    load_before = os.getloadavg()
    cluster = VirtualCluster(spec, profile)
    facts = cluster.run(requests_of(specs, arrivals))
    results = [r.result() for r in cluster.requests]
    duration = max(facts["sim_duration_s"], 1e-9)
    figures = scale_report.arm_figures(results, duration, 1.0, args.slo_ttft_ms / 1000, args.slo_tbt_ms / 1000)
    busy = facts.pop("prefill_busy")
    dbusy = facts.pop("decode_busy")
    return {"arm": arm, "clock": "virtual", "prefills": spec.prefills, "decodes": n_decodes,
            "policy": spec.policy, "load_weight": spec.load_weight, "picker": spec.picker, **facts,
            "prefill_busy_mean": sum(busy) / len(busy), "prefill_busy_max": max(busy),
            "decode_busy_mean": sum(dbusy) / len(dbusy), "decode_busy_max": max(dbusy),
            "load_avg_before": load_before, "load_avg_after": os.getloadavg(), **figures,
            "ttfts_s": [r.ttft for r in results if r.ttft is not None] if len(results) <= 2000 else None}


_WORK: tuple | None = None  # what a forked worker of ``run_arms`` reads (set by its parent before the fork)


def _run_one(arm: str) -> dict:
    args, layouts, profile, work, max_len = _WORK  # type: ignore[misc]
    specs, arrivals = work[arm]
    return run_arm(args, arm, layouts[arm], profile, specs, arrivals, max_len)


def run_arms(args, arms: list[str], layouts: dict, profile: SimProfile, work: dict, max_len: int,
             jobs: int = 1) -> list[dict]:
    """Every arm, ``jobs`` at a time in forked processes (each arm is one process's work: a fresh cluster),
    in ``arms`` order; ``work``: arm -> (specs, arrivals)."""
    global _WORK
    if jobs <= 1 or len(arms) <= 1:
        return [run_arm(args, arm, layouts[arm], profile, *work[arm], max_len) for arm in arms]
    _WORK = (args, layouts, profile, work, max_len)
    try:
        with ProcessPoolExecutor(min(jobs, len(arms)), mp_context=multiprocessing.get_context("fork")) as pool:
            return list(pool.map(_run_one, arms))
    finally:
        _WORK = None


def fidelity(wall_runs: list[dict], virtual_runs: list[dict]) -> dict:
    """arm -> {figure: virtual / wall}."""
    wall = {r["arm"]: r for r in wall_runs}
    out = {}
    for v in virtual_runs:
        w = wall.get(v["arm"])
        if w is not None:
            out[v["arm"]] = {f: report.ratio(v.get(f), w.get(f)) for f in FIDELITY_FIGURES}
    return out


def format_lines(doc: dict) -> list[str]:
    lines = []
    for r in doc.get("virtual_runs") or []:
        lines.append(f"virtual {r['arm']}: {scale_report.one_line(r)}; prefills busy {r['prefill_busy_mean']:.1%} "
                     f"(max {r['prefill_busy_max']:.1%}), prompt tokens from the prefills' caches "
                     f"{r['prefill_cached_share']:.1%}, decodes' {r['decode_cached_share']:.1%}; "
                     f"{r['events']} events in {r['wall_s']:.0f} s")
    for arm, row in (doc.get("fidelity") or {}).items():
        lines.append(f"fidelity {arm} (virtual / wall): " + ", ".join(
            f"{k} {v:.2f}" for k, v in row.items() if v is not None))
    return lines
