"""Experiment 6's figures from one arm's measurements (pure), its targets, and its plot.

``arm_figures(run, trace, (slo_ttft_s, slo_tbt_s), bucket_s)``: a request attains the SLO when
it completed with TTFT <= slo_ttft_s and mean time between tokens <= slo_tbt_s. Over time,
requests are bucketed by arrival. Recovery: seconds from the burst's start to the end of the
last bucket (from the burst on) below 0.95; 0 when none dipped; None when the last bucket is
still below. Process-seconds: prefill + decode processes alive (starting, ready, draining or
restarting) integrated over the run. Direction changes: scale events whose direction differs
from the previous event's (the first event counts as one).
"""

from __future__ import annotations

import math
from pathlib import Path

from pdserve.bench.loadgen_report import percentile

from . import report
from .load_trace import LoadTrace

GOOD = 0.95
LOAD_CHANGES = 2  # the trace changes load twice: the burst, the ramp down
SERVING_ROLES = ("prefill", "decode")


def met(r: dict, slo: tuple[float, float]) -> bool:
    return bool(r["ok"]) and r["ttft"] is not None and r["ttft"] <= slo[0] and r.get("mean_tbt", 0.0) <= slo[1]


def attainment_over_time(results: list[dict], slo, bucket_s: float,
                         duration_s: float) -> list[tuple[float, float | None, int]]:
    """[(bucket start, attainment or None, requests)] by arrival time."""
    out = []
    for k in range(math.ceil(duration_s / bucket_s)):
        lo, hi = k * bucket_s, (k + 1) * bucket_s
        inside = [r for r in results if lo <= r["sent_at"] < hi]
        out.append((lo, sum(met(r, slo) for r in inside) / len(inside) if inside else None, len(inside)))
    return out


def recovery_s(buckets, bucket_s: float, burst_at: float) -> float | None:
    after = [(t, a) for t, a, _ in buckets if t + bucket_s > burst_at and a is not None]
    bad = [t for t, a in after if a < GOOD]
    if not bad:
        return 0.0
    if bad[-1] == after[-1][0]:
        return None
    return round(bad[-1] + bucket_s - burst_at, 1)


def processes(samples: list, end_s: float) -> tuple[float, list[tuple[float, int, int]]]:
    """(process-seconds of prefill + decode until end_s, [(t, decodes alive, decodes ready)])."""
    total, timeline = 0.0, []
    for (t, counts), nxt in zip(samples, samples[1:] + [(end_s, None)]):
        if t >= end_s:
            break
        alive = sum(n for role in SERVING_ROLES for state, n in counts.get(role, {}).items() if state != "gone")
        total += alive * (min(nxt[0], end_s) - t)
        decodes = counts.get("decode", {})
        timeline.append((round(t, 2), sum(n for s, n in decodes.items() if s != "gone"), decodes.get("ready", 0)))
    return total, timeline


def direction_changes(events: list[dict], pool: str) -> int:
    dirs = [1 if e["to"] > e["from"] else -1 for e in events if e["pool"] == pool]
    return sum(1 for i, d in enumerate(dirs) if i == 0 or d != dirs[i - 1])


def arm_figures(run: dict, trace: LoadTrace, slo: tuple[float, float], bucket_s: float) -> dict:
    results = run["results"]
    ok = [r for r in results if r["ok"]]
    cut = [r for r in results if not r["ok"] and r["ttft"] is not None]
    buckets = attainment_over_time(results, slo, bucket_s, trace.duration_s)
    proc_s, timeline = processes(run["servers"], run["wall_s"])
    ttfts = [r["ttft"] for r in ok]
    return {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "cut_mid_stream": len(cut), "failures": sorted({r["error"][:120] for r in results if not r["ok"]})[:5],
        "slo_attainment": round(sum(met(r, slo) for r in results) / len(results), 4) if results else None,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90), "ttft_p99_s": percentile(ttfts, 99),
        "recovery_s": recovery_s(buckets, bucket_s, trace.burst_at),
        "process_seconds": round(proc_s, 1), "max_decodes": max((d for _, d, _ in timeline), default=0),
        "scale_events": len(run["scale_events"]),
        "direction_changes": {pool: direction_changes(run["scale_events"], pool) for pool in SERVING_ROLES},
        "sessions_finished_by_drained_decodes": sum(run["sessions_finished_by_drained_decodes"]),
        "attainment_over_time": buckets, "decodes_over_time": timeline,
    }


def targets(figures: dict, trace: LoadTrace) -> dict:
    lines, checks = [], {}
    a = figures.get("autoscale")
    if a is None:
        return {"checks": checks, "lines": ["no autoscale arm: no targets to check"]}

    def check(name: str, value, target: str, ok: bool) -> None:
        checks[name] = {"value": value, "target": target, "met": ok}
        lines.append(f"  {name}: {value} (target {target}): {'met' if ok else 'MISSED'}")

    check("slo_attainment", a["slo_attainment"], f">= {GOOD}", (a["slo_attainment"] or 0) >= GOOD)
    check("requests_killed_by_scale_down", a["cut_mid_stream"], "0", a["cut_mid_stream"] == 0)
    worst = max(a["direction_changes"].values())
    check("direction_changes", a["direction_changes"], f"<= {LOAD_CHANGES} ({LOAD_CHANGES} load changes)",
          worst <= LOAD_CHANGES)
    if "over" in figures and figures["over"]["process_seconds"]:
        share = round(a["process_seconds"] / figures["over"]["process_seconds"], 3)
        check("process_seconds_vs_over", share, "<= 0.7", share <= 0.7)
    return {"checks": checks, "lines": ["targets (autoscale arm):", *lines]}


def describe(arm: str, f: dict) -> str:
    rec = "never" if f["recovery_s"] is None else f"{f['recovery_s']}s"
    return (f"{arm:>9}: attainment {f['slo_attainment']}, TTFT p90 {_ms(f['ttft_p90_s'])} ms, failed {f['failed']} "
            f"(cut mid-stream {f['cut_mid_stream']}), recovery after the burst {rec}, process-seconds "
            f"{f['process_seconds']}, decodes up to {f['max_decodes']}, scale events {f['scale_events']}")


def _ms(v):
    return None if v is None else round(v * 1000)


def plot(runs: dict, figures: dict, trace: LoadTrace, path: Path) -> Path:
    plt = report.pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(11, 10), sharex=True)
    ts = [i * 0.5 for i in range(int(trace.duration_s * 2) + 1)]
    axes[0].plot(ts, [trace.rate_at(t) for t in ts], color="black", label="offered load")
    axes[0].set_ylabel("requests / s")
    axes[0].set_title("load trace: quiet, burst + plateau, ramp down, quiet")
    for arm, f in figures.items():
        pts = [(t, a) for t, a, _ in f["attainment_over_time"] if a is not None]
        axes[1].step([t for t, _ in pts], [a for _, a in pts], where="post", label=f"{arm} ({f['slo_attainment']})")
        axes[2].step([t for t, _, _ in f["decodes_over_time"]], [d for _, d, _ in f["decodes_over_time"]], where="post",
                     label=f"{arm} ({f['process_seconds']:g} process-s)")
    axes[1].axhline(GOOD, color="grey", ls="--", lw=1)
    axes[1].set_ylabel("SLO attainment")
    axes[1].set_ylim(-0.05, 1.05)
    axes[1].set_title("requests meeting the SLO, by arrival")
    for e in runs.get("autoscale", {}).get("scale_events", []):
        axes[2].axvline(e["t"], color="tab:blue", alpha=0.25, lw=1)
    axes[2].set_ylabel("decode processes")
    axes[2].set_xlabel("time since the trace started (s)")
    axes[2].set_title("decode replicas (autoscale's scale events as vertical lines)")
    for ax in axes:
        for _, start, _ in trace.phases()[1:]:
            ax.axvline(start, color="grey", alpha=0.4, lw=0.8)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
    fig.suptitle("Experiment 6: pdserve up --autoscale vs static clusters, same trace")
    return report.save_figure(fig, path)
