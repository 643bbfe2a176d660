"""Experiments at full rate on simulated clusters (issue 50 item 4): ``pdserve bench experiment scale``.

Mooncake's conversation trace whole (``scale_workload.full_workload``: all its requests, real lengths and arrival
times) on ``--prefills`` + ``--decodes`` servers of ``--engine sim`` behind ``pdserve router``, the step time of
``--profile`` (default ``h200-llama3-8b``: Llama-3-8B on an H200, from the GPU check), one arm at a time, each on a
fresh cluster (cold caches):

- ``round-robin``, ``least-loaded``, ``prefix``: the router's policies (``trace_routing.ARMS``: least loaded is
  ``prefix`` with a load weight no prompt outweighs); the decodes picked by weighted round robin (``wrr``);
- ``wrr``, ``rr`` (with ``--picker-decodes``, default 64): prefix routing, the prefills' decode picker
  (``--policy wrr|rr``) over that many decodes;
- ``day``: prefix routing on a compressed day (``scale_workload.daily_cycle``: the trace's conversations on a
  daily cycle squeezed into ``--day-s``), static at the full cluster;
- ``day-planner``, ``day-peak``, ``day-mean`` (``scale_day.py``): that day on ``pdserve up --engine sim
  --autoscale``, the SLO planner sizing both pools against fixed sizing at the day's peak and at its mean:
  SLO attainment, goodput and pod-seconds per arm.

What is simulated, and what is real. The servers are the real processes (router, prefills' Session, picker, SLO
queue, KV events, the real scheduler, BlockManager and prefix cache); each engine step sleeps the profile's time
(``engine/sim``); KV moves through the real CacheStore as a scaled payload (``--kv-scale``: 1/N of the 8B shape's
bytes, so 40 pools fit this box) that waits the modelled link time of the real bytes (``--link-gbps``,
``--link-latency-us``; ``cachestore/link_model.py``). ``--speedup k`` runs the simulated clock k times faster than
the wall clock: the profile's step times and the link time divided by k, arrivals divided by k, and every figure
reported multiplied back (TTFT, TPOT in simulated seconds; goodput in simulated requests per second); what does
not scale (the router's load polls, Python's own time per step and per token) is the error that grows with k,
which the report measures: the decode's TPOT against the profile's step time at its batch. The profile's context
is raised to the trace's longest request (``derive_profile``; Llama-3.1-8B's 128K shape, the step time
extrapolated past the 8K it was measured at).

``--clock virtual`` serves the same arms in one process on a discrete-event clock instead (``scale_virtual.py``,
``virtual_*.py``): the same router decision, sim engines (scheduler, BlockManager, prefix cache), decode picker and
link model, time advanced by events, so the whole trace runs in minutes whatever the box's load; ``--clock both``
runs each arm on both and reports virtual / wall per figure (the drift). ``--rate-scale k`` divides the trace's
arrival times by k (the load raised, its lengths and reuse kept).

Figures per arm (``scale_report.py``): TTFT p50/p99, TPOT p50/p99, goodput under ``--slo-ttft-ms`` /
``--slo-tbt-ms``, failed requests; ratios over round robin (``rr`` for the picker arms); the targets (issue 50:
prefix P99 TTFT <= 0.5x round robin, goodput >= 1.3x) beside the trace's reuse bound (``reuse_bound``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from pdserve.engine.sim.profile import StepTime, load_profile

from . import report, scale_day, scale_day_figure, scale_report, scale_virtual
from .client import send
from .cluster import start_routed
from .launcher import LOG_ROOT, Launcher
from .prefix import wait_routable
from .scale_workload import daily_cycle, full_workload, rate_by_bin, reuse_bound, unqueued_ttft
from .trace_routing import ARMS as ROUTER_ARMS
from ..trace_replay import MOONCAKE_TRACE, read_trace

PICKER_ARMS = {"wrr": ["--policy", "wrr"], "rr": ["--policy", "rr"]}
ALL_ARMS = (*ROUTER_ARMS, *PICKER_ARMS, "day", *scale_day.DAY_ARMS)
CLOCKS = ("wall", "virtual", "both")
SIM_MODEL = "tiny"  # the built-in name: the sim servers and the router read its byte-level tokenizer (no weights)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--trace", type=Path, default=MOONCAKE_TRACE, help="Mooncake JSONL (default: %(default)s)")
    g.add_argument("--max-requests", type=int, default=None, help="the trace's first N requests (default: all)")
    g.add_argument("--speedup", type=float, default=1.0,
                   help="simulated seconds per wall second: arrivals, step and link times / k (default 1)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--jobs", type=int, default=1,
                   help="--clock virtual: arms run this many at a time, each in its own process (default 1)")
    g.add_argument("--rate-scale", type=float, default=1.0,
                   help="the trace's arrival rate x this (its times / k: load raised, lengths and reuse kept)")
    g.add_argument("--clock", choices=CLOCKS, default="wall",
                   help="wall: the sim servers as processes, in real time / --speedup; virtual: one process on a "
                        "discrete-event clock (scale_virtual.py: the same router, engines and picker, no sleeps); "
                        "both: each arm on both, and virtual / wall per figure")
    g.add_argument("--day-s", type=float, default=3600.0, help="day arms: simulated seconds of the compressed day")
    g.add_argument("--peak-to-trough", type=float, default=3.0,
                   help="day arms: the day's peak rate / trough (scale_workload.py says why 3)")
    g.add_argument("--day-load", type=float, default=1.0, help="day arms: mean rate x the trace's")
    g.add_argument("--turn-pace", type=float, default=1.0,
                   help="day arms: a conversation's waits between turns / this (1: the trace's users' own pace)")
    g.add_argument("--day-bins", type=int, default=12, help="day arms: parts of the day for its trough and peak")
    g.add_argument("--day-max-factor", type=float, default=2.0,
                   help="day-planner: the most replicas of a pool, x the peak's sizing (at least it + 1)")
    g.add_argument("--plan-interval", type=float, default=1.0, help="day-planner: wall seconds between decisions")
    g.add_argument("--plan-window", type=float, default=4.0, help="day-planner: wall seconds of metrics per decision")
    g.add_argument("--scale-down-window", type=float, default=10.0,
                   help="day-planner: wall seconds of stabilisation before a scale-down")
    g.add_argument("--cooldown", type=float, default=5.0, help="day-planner: wall seconds after a change before a "
                   "scale-down")
    g = parser.add_argument_group("cluster")
    g.add_argument("--arms", default="round-robin,least-loaded,prefix", help=f"comma list of {', '.join(ALL_ARMS)}")
    g.add_argument("--prefills", type=int, default=8)
    g.add_argument("--decodes", type=int, default=32)
    g.add_argument("--picker-decodes", type=int, default=64, help="decodes of the wrr and rr arms")
    g.add_argument("--profile", default="h200-llama3-8b", help="sim profile (file or shipped name)")
    g.add_argument("--num-blocks", type=int, default=13000,
                   help="KV blocks of 64 tokens per server (default: an H200's 141 GB less 8B weights, ~111 GB)")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--kv-scale", type=int, default=1024, help="the CacheStore moves 1/N of the real KV bytes")
    g.add_argument("--link-gbps", type=float, default=400.0, help="modelled KV link per prefill (real bytes)")
    g.add_argument("--link-latency-us", type=float, default=5.0)
    g.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    g.add_argument("--slo-tbt-ms", type=float, default=100.0)
    g.add_argument("--request-timeout", type=float, default=1800.0, help="wall seconds before a request fails")
    g = parser.add_argument_group("output")
    g.add_argument("--out", type=Path, default=Path("bench-results/experiments"))
    g.add_argument("--name", default="scale")
    g.add_argument("--dry-run", action="store_true", help="print the plan and start nothing")


def _say(msg: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def derive_profile(name: str, speedup: float, context: int, out: Path) -> Path:
    """The profile with its step terms / speedup and its context raised to ``context``; written to ``out``."""
    base = load_profile(name)
    step = StepTime(**{k: v / speedup for k, v in dataclasses.asdict(base.step).items()})
    model = dataclasses.replace(base.model, context_length=max(base.model.context_length, context))
    source = (f"{base.source}; derived by pdserve bench experiment scale: step times / {speedup:g} (--speedup), "
              f"context {model.context_length} (measured to {base.model.context_length})")
    derived = dataclasses.replace(base, name=f"{base.name}-x{speedup:g}", source=source, model=model, step=step)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(derived.to_json())
    return out


def ttft_floor(reqs, args) -> dict:
    """The no-queueing TTFT of every request on the profile (``unqueued_ttft``), best router against round robin:
    P50/P99 and the share within the TTFT SLO, what routing could change if the cluster never queued."""
    step = load_profile(args.profile).step
    out = {}
    for name, one in (("one_cache", True), ("round_robin", False)):
        v = sorted(unqueued_ttft(reqs, step.prefill_s, args.prefills, one))
        out[f"unqueued_ttft_{name}"] = {"p50_s": v[len(v) // 2], "p99_s": v[min(len(v) - 1, int(0.99 * len(v)))],
                                        "within_slo": sum(x <= args.slo_ttft_ms / 1000 for x in v) / len(v),
                                        "prefill_busy": sum(v) / args.prefills / max(1e-9, (reqs[-1].time_s
                                                                                       - reqs[0].time_s)
                                                                                      / args.rate_scale)}
    return out


def server_flags(args, profile: Path) -> list[str]:
    return ["--engine", "sim", "--sim-profile", str(profile), "--sim-kv-scale", str(args.kv_scale),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens)]


def arm_layout(args, arm: str) -> tuple[int, list[str], list[str]]:
    """(decodes, router flags, prefill flags) of an arm."""
    if arm in ROUTER_ARMS:
        return args.decodes, ROUTER_ARMS[arm], PICKER_ARMS["wrr"]
    if arm in PICKER_ARMS:
        return args.picker_decodes, ROUTER_ARMS["prefix"], PICKER_ARMS[arm]
    if arm == "day":
        return args.decodes, ROUTER_ARMS["prefix"], PICKER_ARMS["wrr"]
    raise ValueError(f"unknown arm {arm!r}: one of {', '.join(ALL_ARMS)}")


def run_arm(args, arm: str, profile: Path, specs, arrivals, max_len: int) -> dict:
    n_decodes, router_extra, picker = arm_layout(args, arm)
    common = server_flags(args, profile)
    link = ["--sim-link-gbps", f"{args.link_gbps * args.speedup:g}",
            "--sim-link-latency-us", f"{args.link_latency_us / args.speedup:g}"]
    t0, load_before = time.monotonic(), os.getloadavg()
    with Launcher(LOG_ROOT / f"scale-{arm}") as launcher:
        cluster = start_routed(launcher, SIM_MODEL, args.prefills, n_decodes, num_blocks=args.num_blocks,
                               max_model_len=max_len, prefill_extra=common + link + picker, decode_extra=common,
                               router_extra=router_extra)
        wait_routable(cluster, timeout=120)
        started = time.monotonic() - t0
        rss = scale_report.rss_mib([p.popen.pid for p in launcher.procs])
        _say(f"{arm}: {args.prefills} prefills + {n_decodes} decodes + router up in {started:.0f} s, "
             f"RSS {rss['total']:.0f} MiB; {len(specs)} requests over {arrivals[-1]:.0f} wall s")
        pids = [p.popen.pid for p in launcher.procs]
        cpu_before = scale_report.cpu_seconds(pids)
        results, wall = send(cluster.url, specs, arrivals=arrivals, timeout=args.request_timeout)
        cpu = scale_report.cpu_seconds(pids) - cpu_before
    figures = scale_report.arm_figures(results, wall, args.speedup, args.slo_ttft_ms / 1000, args.slo_tbt_ms / 1000)
    _say(f"  {arm}: " + scale_report.one_line(figures))
    return {"arm": arm, "decodes": n_decodes, "start_s": started, "rss_mib": rss, "servers_cpu_s_in_run": cpu,
            "servers_cores_in_run": cpu / wall,
            "wall_s": wall, "load_avg_before": load_before, "load_avg_after": os.getloadavg(), **figures}


def run(args: argparse.Namespace) -> int:
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ALL_ARMS]
    planner_virtual = args.clock != "wall" and any(a in scale_day.DAY_ARMS for a in arms)
    if bad or not arms or args.speedup <= 0 or args.rate_scale <= 0 or args.prefills < 1 or args.decodes < 1 \
            or planner_virtual or args.jobs < 1:
        print(f"pdserve bench experiment scale: error: arms {bad or arms} (one of {', '.join(ALL_ARMS)}; "
              f"{', '.join(scale_day.DAY_ARMS)} on --clock wall only), --speedup and --rate-scale > 0, --prefills "
              "and --decodes >= 1, --jobs >= 1", file=sys.stderr)
        return 2
    reqs = read_trace(args.trace, "mooncake")[: args.max_requests]
    specs, arrivals = full_workload(reqs, args.speedup * args.rate_scale, args.seed)
    bound = reuse_bound(reqs, args.prefills)
    bound.update(ttft_floor(reqs, args))
    day_reqs, cycle = daily_cycle(reqs, args.day_s, args.peak_to_trough, args.day_load, args.seed,
                                  args.turn_pace)
    sizing: dict = {}
    pools: dict = {}
    if any(a in scale_day.DAY_ARMS for a in arms):  # the pools each day arm runs, from the profile
        sizing = scale_day.day_sizing(day_reqs, args.day_s, args.day_bins, load_profile(args.profile).step,
                                      args.max_num_batched_tokens, args.num_blocks, args.slo_tbt_ms / 1000)
        pools = sizing.pop("_pools")
    longest = max(r.input_length + r.output_length for r in reqs + day_reqs)
    max_len = -(-(longest + 64) // 1024) * 1024
    out = Path(args.out)
    plan = (f"{len(specs)} requests over {arrivals[-1] * args.speedup:.0f} simulated s "
            f"({arrivals[-1]:.0f} wall s at --speedup {args.speedup:g}, --clock {args.clock}, rate x "
            f"{args.rate_scale:g}); {sum(s.prompt_tokens for s in specs)} "
            f"prompt tokens; reuse bound: one cache {bound['one_cache']:.1%}, round robin over {args.prefills} "
            f"{bound['round_robin']:.1%}; no-queueing TTFT p99 best router / round robin "
            f"{bound['unqueued_ttft_one_cache']['p99_s'] / bound['unqueued_ttft_round_robin']['p99_s']:.2f}; "
            f"arms {arms}; max_model_len {max_len}")
    if pools:
        r = sizing["rates_rps"]
        plan += (f"; the day: {len(day_reqs)} requests over {args.day_s:g} s, rate trough/mean/peak {r['trough']:.2f}/"
                 f"{r['mean']:.2f}/{r['peak']:.2f} req/s, pools (prefills, decodes) "
                 + ", ".join(f"{k} {v.prefills}+{v.decodes}" for k, v in pools.items()))
    if args.dry_run:
        print("dry run (nothing started)\n" + plan)
        return 0
    _say(plan)
    profile = derive_profile(args.profile, args.speedup, max_len, out / f"{args.name}-profile.json")
    runs: list[dict] = []
    virtual: list[dict] = []
    real_profile = (load_profile(derive_profile(args.profile, 1.0, max_len, out / f"{args.name}-profile-x1.json"))
                    if args.clock != "wall" else None)
    if args.clock == "virtual":  # every arm at once (``--jobs``), then the same report
        assert real_profile is not None
        work = {arm: (full_workload(day_reqs, 1.0, args.seed) if arm == "day" else
                      (specs, [a * args.speedup for a in arrivals])) for arm in arms}
        virtual = scale_virtual.run_arms(args, arms, {a: arm_layout(args, a) for a in arms}, real_profile, work,
                                         max_len, args.jobs)
        for row in virtual:
            _say(f"  {row['arm']} (virtual clock, {row['wall_s']:.0f} s): " + scale_report.one_line(row))
        arms = []
    for arm in arms:
        arm_specs, arm_arrivals = specs, arrivals
        if arm == "day":
            arm_specs, arm_arrivals = full_workload(day_reqs, args.speedup, args.seed)
        if args.clock != "virtual":
            runs.append(_wall_arm(args, arm, profile, arm_specs, arm_arrivals, max_len, day_reqs, pools, cycle))
            report.save(out, args.name, _doc(args, plan, bound, profile, runs, sizing, cycle, virtual))  # partial
        if args.clock != "wall":
            assert real_profile is not None
            row = scale_virtual.run_arm(args, arm, arm_layout(args, arm), real_profile, arm_specs,
                                        [a * args.speedup for a in arm_arrivals], max_len)
            _say(f"  {arm} (virtual clock, {row['wall_s']:.0f} s): " + scale_report.one_line(row))
            virtual.append(row)
            report.save(out, args.name, _doc(args, plan, bound, profile, runs, sizing, cycle, virtual))  # partial
    doc = _doc(args, plan, bound, profile, runs, sizing, cycle, virtual)
    path = report.save(out, args.name, doc)
    print(scale_report.format_table(doc))
    print("\n".join(scale_virtual.format_lines(doc)))
    print("\n".join(scale_day.format_lines(doc)))
    png = scale_day_figure.plot(runs, out / f"{args.name}-day.png", args.speedup)
    if png is not None:
        print(f"wrote {png}")
    print(f"wrote {path}")
    return 0


def _wall_arm(args, arm: str, profile: Path, specs, arrivals, max_len: int, day_reqs, pools, cycle) -> dict:
    """One arm on the process cluster (``--clock wall``)."""
    if arm in scale_day.DAY_ARMS:
        return scale_day.run_arm(args, arm, profile, day_reqs, pools, max_len, _say)
    row = run_arm(args, arm, profile, specs, arrivals, max_len)
    if arm == "day":
        row["day"] = {**dataclasses.asdict(cycle), "requests": len(day_reqs),
                      "rate_by_bin": rate_by_bin([r.time_s for r in day_reqs], args.day_s, 24)}
    return row


def _doc(args, plan: str, bound: dict, profile: Path, runs: list[dict], sizing: dict, cycle,
         virtual: list[dict] | None = None) -> dict:
    """The run's JSON: ``runs`` (and its ratios and targets) are the wall clock's, or the virtual clock's when only
    it ran; with both clocks the virtual arms are ``virtual_runs`` and ``fidelity`` is virtual / wall."""
    params = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
    virtual = virtual or []
    main = runs or virtual
    compared = scale_report.compare(main)
    doc = {"params": params, "plan": plan, "reuse_bound": bound, "profile": json.loads(profile.read_text()),
           "clock": args.clock, "runs": main, "ratios": compared, "targets": scale_report.targets(compared),
           "day": {**dataclasses.asdict(cycle), **sizing},
           "day_verdict": scale_day.verdict(runs, args.slo_ttft_ms / 1000, args.slo_tbt_ms / 1000)}
    if runs and virtual:
        compared_v = scale_report.compare(virtual)
        doc.update(virtual_runs=virtual, virtual_ratios=compared_v, virtual_targets=scale_report.targets(compared_v),
                   fidelity=scale_virtual.fidelity(runs, virtual))
    elif virtual:
        doc["virtual_runs"] = virtual
    return doc
