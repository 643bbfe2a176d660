"""The SLO planner over a compressed day (issue 50 item 4): the ``day-*`` arms of ``pdserve bench experiment scale``.

The day (``scale_workload.daily_cycle``): the trace's conversations, its own lengths and prefix reuse, started on
a smooth daily curve of peak-to-trough ratio ``--peak-to-trough``, squeezed into ``--day-s`` simulated seconds.
Each arm is one ``pdserve up --engine sim --autoscale`` (the planner's actuator there starts and drains sim
servers: ``localcluster/autoscale.py``), on the same day, one after the other, each from cold caches:

- ``day-planner``: the planner sizes both pools through the day: it starts at the trough's sizing and may go
  from 1 to ``--day-max-factor`` x the peak's;
- ``day-peak``: fixed at the sizing the day's peak needs (min = max = start: the planner's loop runs and records
  what it would want, but cannot change anything);
- ``day-mean``: fixed at the sizing the day's mean rate needs.

The sizings (``day_sizing``) are arithmetic on the day and the profile, what an operator with the trace in hand
would provision at the planner's own targets: prefills so the prompts' compute (``request_cost``: each request's
prompt less what one perfect prefix cache holds, in ``--max-num-batched-tokens`` chunks) keeps them
``busy_target`` busy; decodes so the requests in flight (Little's law on the profile's decode step) fill
``kv_target`` of their KV and the step stays within the TBT target (``pools_for``). The rates are the day's
mean and the highest and lowest of ``--day-bins`` equal parts of it.

Cost is pod-seconds (``pod_seconds``): prefill and decode processes that run (starting, ready or draining: a pod
costs from its start until it has exited), sampled from ``servers.json`` every half second, integrated over the
replay, in simulated seconds. The router runs in every arm alike and is not counted. Figures per arm: SLO
attainment (TTFT, mean TBT, both), the day's p90 TTFT and p90 time between tokens (what the planner targets),
goodput, pod-seconds and SLO-met requests per pod-hour, and per ``--day-bins`` part of the day the arrival
rate, the pods running and the attainment (``timeline``).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.defaults import BLOCK_SIZE
from pdserve.engine.sim.profile import StepTime
from pdserve.net import free_ports

from . import scale_report
from .autoscale import Monitor, compact, wait_all_ready
from .client import send
from .launcher import LOG_ROOT, Launcher
from .scale_workload import full_workload, rate_by_bin, served_by_one_cache

DAY_ARMS = ("day-planner", "day-peak", "day-mean")
POD_STATES = ("starting", "ready", "draining")  # a process that runs, so a pod that costs
POOL_ROLES = ("prefill", "decode")
MODEL = "tiny"  # the built-in name: sim servers and the router read its byte-level tokenizer (no weights)
BUSY_TARGET, KV_TARGET = 0.7, 0.7  # the planner's defaults (planner/config.py): what the sizings aim at too


@dataclass(frozen=True, slots=True)
class Pools:
    prefills: int
    decodes: int

    @property
    def pods(self) -> int:
        return self.prefills + self.decodes


@dataclass(frozen=True, slots=True)
class RequestCost:
    """A day's mean request on a profile."""

    prefill_busy_s: float  # prefill compute: its prompt less what one perfect prefix cache holds, in chunks
    output_tokens: float
    decode_context: float  # a decode row's mean context: prompt + half its output
    kv_tokens: float       # what a decode reserves for it: prompt + output


def request_cost(reqs, step: StepTime, chunk_tokens: int) -> RequestCost:
    if not reqs:
        raise ValueError("no requests to cost")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    busy = 0.0
    for r, served in zip(reqs, served_by_one_cache(reqs)):
        new = r.input_length - served
        busy += (step.prefill_token_s * new + step.prefill_pair_s * new * (served + (new + 1) / 2)
                 + step.base_s * math.ceil(new / chunk_tokens))
    n = len(reqs)
    return RequestCost(busy / n, sum(r.output_length for r in reqs) / n,
                       sum(r.input_length + r.output_length / 2 for r in reqs) / n,
                       sum(r.input_length + r.output_length for r in reqs) / n)


def pools_for(rate: float, cost: RequestCost, step: StepTime, num_blocks: int, tbt_target_s: float,
              max_decodes: int = 1024) -> Pools:
    """The pools that hold ``rate`` requests/s at the planner's targets (module docstring). Decode: ``C`` requests
    in flight on ``D`` decodes each decode a token every ``base + (C / D) * k`` s (``k``: one row of the mean
    context), and ``C = rate * output * step`` (Little), so ``C = rate * output * base / (1 - rate * output * k / D)``;
    ``D`` is the least count where that is finite, ``C * kv_tokens`` fits ``kv_target`` of the KV and the step is
    within ``tbt_target_s``."""
    if rate < 0 or num_blocks < 1 or not tbt_target_s > 0:
        raise ValueError(f"need rate >= 0, num_blocks >= 1, tbt_target_s > 0; got {rate}, {num_blocks}, "
                         f"{tbt_target_s}")
    prefills = max(1, math.ceil(round(rate * cost.prefill_busy_s / BUSY_TARGET, 9)))
    k = step.decode_seq_s + step.decode_context_token_s * cost.decode_context
    demand = rate * cost.output_tokens
    for decodes in range(1, max_decodes + 1):
        left = 1 - demand * k / decodes
        if left <= 0:
            continue
        in_flight = demand * step.base_s / left
        fits = in_flight * cost.kv_tokens <= decodes * num_blocks * BLOCK_SIZE * KV_TARGET
        if fits and step.base_s + in_flight / decodes * k <= tbt_target_s:
            return Pools(prefills, decodes)
    raise ValueError(f"{rate:g} requests/s need more than {max_decodes} decodes on this profile")


def day_sizing(day_reqs, day_s: float, bins: int, step: StepTime, chunk_tokens: int, num_blocks: int,
               tbt_target_s: float) -> dict:
    """The day's trough, mean and peak request rates (``bins`` parts of the day) and the pools each needs."""
    per_bin = rate_by_bin([r.time_s for r in day_reqs], day_s, bins)
    rates = {"trough": min(per_bin), "mean": len(day_reqs) / day_s, "peak": max(per_bin)}
    cost = request_cost(day_reqs, step, chunk_tokens)
    pools = {name: pools_for(rate, cost, step, num_blocks, tbt_target_s) for name, rate in rates.items()}
    return {"rates_rps": rates, "cost": asdict(cost), "pools": {k: asdict(v) for k, v in pools.items()},
            "_pools": pools}


def arm_bounds(arm: str, pools: dict[str, Pools], max_factor: float) -> dict[str, tuple[int, int, int]]:
    """role -> (start, min, max) replicas of an arm."""
    if arm == "day-planner":
        trough, peak = pools["trough"], pools["peak"]
        return {role: (getattr(trough, f"{role}s"), 1,
                       max(getattr(peak, f"{role}s") + 1, math.ceil(getattr(peak, f"{role}s") * max_factor)))
                for role in POOL_ROLES}
    fixed = {"day-peak": "peak", "day-mean": "mean"}.get(arm)
    if fixed is None:
        raise ValueError(f"unknown day arm {arm!r}: one of {', '.join(DAY_ARMS)}")
    return {role: (getattr(pools[fixed], f"{role}s"),) * 3 for role in POOL_ROLES}


def running(counts: dict, role: str) -> int:
    """Processes of ``role`` that run in one ``Monitor`` sample."""
    return sum(counts.get(role, {}).get(s, 0) for s in POD_STATES)


def pod_seconds(samples: list[tuple[float, dict]], end_s: float) -> dict[str, float]:
    """Pod-seconds by role from [0, end_s] of ``Monitor`` samples ``(t, {role: {state: n}})``: each sample's count
    holds until the next (the first from 0)."""
    out = {role: 0.0 for role in POOL_ROLES}
    for i, (t, counts) in enumerate(samples):
        start = 0.0 if i == 0 else max(0.0, t)
        stop = min(end_s, samples[i + 1][0] if i + 1 < len(samples) else end_s)
        if stop > start:
            for role in POOL_ROLES:
                out[role] += (stop - start) * running(counts, role)
    out["total"] = sum(out[role] for role in POOL_ROLES)
    return out


def timeline(results: list[dict], samples: list[tuple[float, dict]], day_wall_s: float, bins: int,
             slo_ttft_s: float, slo_tbt_s: float) -> list[dict]:
    """Per part of the day (wall seconds, by send time): requests/s sent, mean pods running, SLO attainment."""
    width = day_wall_s / bins
    rows = []
    for b in range(bins):
        lo, hi = b * width, (b + 1) * width
        mine = [r for r in results if lo <= r["sent_at"] < hi]
        met = [r for r in mine if r["ok"] and r["ttft"] is not None and r["ttft"] <= slo_ttft_s
               and r["mean_tbt"] <= slo_tbt_s]
        inside = [(t, c) for t, c in samples if lo <= t < hi]
        pods = {role: (sum(running(c, role) for _, c in inside) / len(inside) if inside else None)
                for role in POOL_ROLES}
        rows.append({"from_s": lo, "rps": len(mine) / width, "prefills": pods["prefill"], "decodes": pods["decode"],
                     "slo_attained": len(met) / len(mine) if mine else None})
    return rows


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def day_figures(results: list[dict], wall_s: float, speedup: float, slo_ttft_s: float, slo_tbt_s: float) -> dict:
    """Simulated-time figures of one day arm from its compacted results (``autoscale.compact``)."""
    ok = [r for r in results if r["ok"]]
    n = len(results) or 1
    ttft_met = [r for r in ok if r["ttft"] is not None and r["ttft"] * speedup <= slo_ttft_s]
    tbt_met = [r for r in ok if r["mean_tbt"] * speedup <= slo_tbt_s]
    both = [r for r in ttft_met if r["mean_tbt"] * speedup <= slo_tbt_s]
    ttfts = [r["ttft"] * speedup for r in ok if r["ttft"] is not None]
    return {"requests": len(results), "failed": len(results) - len(ok),
            "ttft_attained": len(ttft_met) / n, "tbt_attained": len(tbt_met) / n, "slo_attained": len(both) / n,
            "ttft_p50_s": quantile(ttfts, 0.5), "ttft_p90_s": quantile(ttfts, 0.9),
            "ttft_p99_s": quantile(ttfts, 0.99),
            "tbt_mean_p90_s": quantile([r["mean_tbt"] * speedup for r in ok], 0.9),
            "tbt_max_p99_s": quantile([r["max_tbt"] * speedup for r in ok], 0.99),
            "goodput_rps": len(both) / (wall_s * speedup), "sim_duration_s": wall_s * speedup}


def up_argv(args, arm: str, bounds: dict, profile: Path, max_len: int, port: int, grpc_port: int,
            log_dir: Path) -> list[str]:
    """``pdserve up`` for one day arm: sim servers, the planner with the SLO in wall seconds (/ speedup)."""
    (p0, pmin, pmax), (d0, dmin, dmax) = bounds["prefill"], bounds["decode"]
    extra = f"--sim-kv-scale {args.kv_scale} --max-model-len {max_len} --log-level WARNING"
    link = (f"--sim-link-gbps {args.link_gbps * args.speedup:g} "
            f"--sim-link-latency-us {args.link_latency_us / args.speedup:g}")
    return ["up", "--engine", "sim", "--sim-profile", str(profile), "--model", MODEL, "--num-blocks",
            str(args.num_blocks), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--prefill", str(p0), "--decode", str(d0), "--autoscale", "--min-prefill", str(pmin), "--max-prefill",
            str(pmax), "--min-decode", str(dmin), "--max-decode", str(dmax),
            "--slo-ttft-ms", f"{args.slo_ttft_ms / args.speedup:g}",
            "--slo-tbt-ms", f"{args.slo_tbt_ms / args.speedup:g}",
            "--plan-interval", f"{args.plan_interval:g}", "--plan-window", f"{args.plan_window:g}",
            "--scale-down-window", f"{args.scale_down_window:g}", "--cooldown", f"{args.cooldown:g}",
            f"--extra={extra}", f"--prefill-extra={link}", "--port", str(port), "--grpc-port", str(grpc_port),
            "--log-dir", str(log_dir), "--ready-timeout", "300"]


def scale_events(path: Path, wall0: float) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        d = json.loads(line)
        if d["desired"] != d["current"]:
            out.append({"t": round(d["time"] - wall0, 2), "pool": d["pool"], "from": d["current"],
                        "to": d["desired"], "reason": d["reason"]})
    return out


def run_arm(args, arm: str, profile: Path, day_reqs, pools: dict[str, Pools], max_len: int, say) -> dict:
    """One day arm on a fresh ``pdserve up``: its figures, pod-seconds, scale events and timeline."""
    bounds = arm_bounds(arm, pools, args.day_max_factor)
    specs, arrivals = full_workload(day_reqs, args.speedup, args.seed)
    log_dir = LOG_ROOT / f"scale-{arm}"
    port, grpc_port = free_ports(2)
    url = f"http://127.0.0.1:{port}"
    argv = up_argv(args, arm, bounds, profile, max_len, port, grpc_port, log_dir / "up")
    t_start, load_before = time.monotonic(), os.getloadavg()
    with Launcher(log_dir) as launcher:
        proc = launcher.start(f"up-{arm}", argv)
        launcher.wait_ready(proc, url + "/ready", timeout=300)
        wait_all_ready(log_dir / "up" / "servers.json", proc)
        started = time.monotonic() - t_start
        say(f"{arm}: up in {started:.0f} s, bounds {bounds}; {len(specs)} requests over {arrivals[-1]:.0f} wall s")
        (log_dir / "up" / "autoscale.jsonl").unlink(missing_ok=True)  # decisions of the measured day only
        t0, wall0 = time.perf_counter(), time.time()
        monitor = Monitor(log_dir / "up" / "servers.json", t0)
        monitor.start()
        results, wall = send(url, specs, arrivals=arrivals, timeout=args.request_timeout, model=MODEL)
        monitor.done.set()
        monitor.join(5)
        events = scale_events(log_dir / "up" / "autoscale.jsonl", wall0)
    rows = [compact(r.to_json()) for r in results]
    slo_ttft, slo_tbt = args.slo_ttft_ms / 1000, args.slo_tbt_ms / 1000
    figures = {**scale_report.arm_figures(results, wall, args.speedup, slo_ttft, slo_tbt),
               **day_figures(rows, wall, args.speedup, slo_ttft, slo_tbt),
               "tbt_p90_s": quantile([g * args.speedup for r in results if r.ok for g in r.gaps], 0.9)}
    pods = {k: v * args.speedup for k, v in pod_seconds(monitor.samples, wall).items()}
    hours = pods["total"] / 3600
    say(f"  {arm}: SLO met {figures['slo_attained']:.1%} (TTFT {figures['ttft_attained']:.1%}, TBT "
        f"{figures['tbt_attained']:.1%}), goodput {figures['goodput_rps']:.2f} req/s, {pods['total']:.0f} pod-s, "
        f"{len(events)} scale events")
    return {"arm": arm, "decodes": f"{bounds['decode'][1]}-{bounds['decode'][2]}", "bounds": bounds,
            "start_s": started, "wall_s": wall, "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
            **figures, "pod_seconds": pods,
            "slo_met_per_pod_hour": (figures["slo_attained"] * figures["requests"] / hours) if hours else None,
            "scale_events": events, "pods_over_time": [(round(t, 2), running(c, "prefill"), running(c, "decode"))
                                                       for t, c in monitor.samples],
            "timeline": timeline(rows, monitor.samples, arrivals[-1], args.day_bins, slo_ttft / args.speedup,
                                 slo_tbt / args.speedup),
            "results": rows, "logs": str(log_dir / "up")}


def verdict(runs: list[dict], slo_ttft_s: float, slo_tbt_s: float) -> dict:
    """The planner against peak and mean sizing: pod-seconds and goodput ratios, the difference in SLO attainment,
    and the target: the planner holds the SLO (``slo_held``) at fewer pod-seconds than peak sizing."""
    by_arm = {r["arm"]: r for r in runs}
    plan = by_arm.get("day-planner")
    out: dict = {}
    if plan is None:
        return out
    peak = by_arm.get("day-peak")
    if peak is not None:
        held, fewer = slo_held(plan, slo_ttft_s, slo_tbt_s), plan["pod_seconds"]["total"] < peak["pod_seconds"]["total"]
        out["target"] = {"planner_held_slo": held, "fewer_pod_seconds_than_peak": fewer,
                         "verdict": "met" if held and fewer else "MISSED"}
    for base in ("day-peak", "day-mean"):
        if base in by_arm:
            b = by_arm[base]
            out[f"planner / {base.removeprefix('day-')}"] = {
                "pod_seconds": plan["pod_seconds"]["total"] / b["pod_seconds"]["total"],
                "slo_attained": plan["slo_attained"] - b["slo_attained"],
                "goodput_rps": (plan["goodput_rps"] / b["goodput_rps"]) if b["goodput_rps"] else None}
    return out


def slo_held(run: dict, slo_ttft_s: float, slo_tbt_s: float) -> bool:
    """The day's p90 TTFT and p90 time between tokens within target (the planner's SLO: p90 of each)."""
    ttft, tbt = run.get("ttft_p90_s"), run.get("tbt_p90_s")
    return ttft is not None and tbt is not None and ttft <= slo_ttft_s and tbt <= slo_tbt_s


def format_lines(doc: dict) -> list[str]:
    runs = [r for r in doc["runs"] if r["arm"] in DAY_ARMS]
    if not runs:
        return []
    slo_ttft, slo_tbt = doc["params"]["slo_ttft_ms"] / 1000, doc["params"]["slo_tbt_ms"] / 1000
    lines = [f"{'day arm':<13}{'pods':>8}{'pod-s':>8}{'SLO met':>9}{'TTFT':>7}{'TBT':>7}{'p90 TTFT':>10}"
             f"{'p90 TBT':>9}{'goodput':>9}{'held':>6}"]
    for r in runs:
        b = r["bounds"]
        pods = f"{b['prefill'][1]}-{b['prefill'][2]}/{b['decode'][1]}-{b['decode'][2]}"
        lines.append(f"{r['arm']:<13}{pods:>8}{r['pod_seconds']['total']:>8.0f}{r['slo_attained']:>9.1%}"
                     f"{r['ttft_attained']:>7.1%}{r['tbt_attained']:>7.1%}{(r['ttft_p90_s'] or 0):>10.2f}"
                     f"{(r['tbt_p90_s'] or 0) * 1000:>8.0f}m{r['goodput_rps']:>9.2f}"
                     f"{'yes' if slo_held(r, slo_ttft, slo_tbt) else 'no':>6}")
    for name, v in doc.get("day_verdict", {}).items():
        if name == "target":
            lines.append(f"target: the planner holds the SLO at fewer pod-seconds than peak sizing: {v['verdict']}")
        else:
            lines.append(f"{name}: pod-seconds {v['pod_seconds']:.2f}x, SLO met {v['slo_attained']:+.1%}")
    return lines
