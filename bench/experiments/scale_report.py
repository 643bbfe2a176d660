"""What the scale experiment reports (``scale.py``): per-arm figures in simulated time, ratios, targets.

A run at ``--speedup k`` measures wall seconds in which k simulated seconds pass: a latency measured ``x`` wall
seconds is ``k * x`` simulated seconds, a rate of ``r`` per wall second is ``r / k`` per simulated second, and
an SLO of ``s`` simulated seconds is met when the wall latency is <= ``s / k`` (``arm_figures``). Ratios are an
arm's figure over its baseline's (``BASELINES``: round robin for the router's policies, ``rr`` for the picker's
WRR); the targets are issue 50's (``TARGETS``). Pure arithmetic but ``rss_mib`` and ``cpu_seconds`` (``/proc``).
"""

from __future__ import annotations

import os

from pdserve.bench.loadgen_report import RequestResult, summarize

from . import report

BASELINES = {"least-loaded": "round-robin", "prefix": "round-robin", "wrr": "rr"}
# (arm, figure) -> (comparison, ratio): issue 50 item 4's targets against the arm's baseline
TARGETS = {("prefix", "ttft_p99_s"): ("<=", 0.5), ("prefix", "goodput_rps"): (">=", 1.3)}
FIGURES = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "goodput_rps", "slo_attained", "failed")


def arm_figures(results: list[RequestResult], wall_s: float, speedup: float, slo_ttft_s: float,
                slo_tbt_s: float) -> dict:
    """One arm's figures in simulated time (module docstring) from the wall-clock results."""
    if not speedup > 0:
        raise ValueError(f"speedup must be > 0, got {speedup}")
    s = summarize(results, wall_s, slo_ttft_s / speedup, slo_tbt_s / speedup)

    def sim(v: float | None) -> float | None:
        return None if v is None else v * speedup

    return {"requests": s["requests"], "failed": s["failed"], "errors": s["errors"],
            "ttft_p50_s": sim(s["ttft_s"]["p50"]), "ttft_p99_s": sim(s["ttft_s"]["p99"]),
            "ttft_mean_s": sim(s["ttft_s"]["mean"]), "tpot_p50_s": sim(s["tpot_s"]["p50"]),
            "tpot_p99_s": sim(s["tpot_s"]["p99"]), "goodput_rps": s["goodput"] / speedup,
            "slo_attained": s["slo_attained"], "request_rps": s["request_throughput"] / speedup,
            "output_tok_s": s["output_token_throughput"] / speedup, "sim_duration_s": wall_s * speedup}


def compare(runs: list[dict]) -> dict:
    """arm -> {figure: ratio over its baseline's}, for each arm whose baseline ran."""
    by_arm = {r["arm"]: r for r in runs}
    out = {}
    for arm, base in BASELINES.items():
        if arm in by_arm and base in by_arm:
            out[arm] = {"baseline": base, **{f: report.ratio(by_arm[arm].get(f), by_arm[base].get(f))
                                            for f in FIGURES if f != "failed"}}
    return out


def targets(compared: dict) -> dict:
    """'{arm} {figure}' -> {target, ratio, verdict} for issue 50's targets whose arms ran."""
    out = {}
    for (arm, figure), (op, bound) in TARGETS.items():
        ratio = compared.get(arm, {}).get(figure)
        if ratio is None:
            verdict = "not run"
        else:
            verdict = "met" if (ratio <= bound if op == "<=" else ratio >= bound) else "MISSED"
        out[f"{arm} {figure}"] = {"target": f"{op} {bound:g}x {BASELINES[arm]}", "ratio": ratio, "verdict": verdict}
    return out


def one_line(f: dict) -> str:
    ms = lambda v: "-" if v is None else f"{v * 1000:.0f}"  # noqa: E731
    return (f"{f['requests'] - f['failed']}/{f['requests']} ok, TTFT p50/p99 {ms(f['ttft_p50_s'])}/"
            f"{ms(f['ttft_p99_s'])} ms, TPOT p50 {ms(f['tpot_p50_s'])} ms, goodput {f['goodput_rps']:.2f} req/s "
            f"(simulated)")


def format_table(doc: dict) -> str:
    lines = [doc["plan"], f"{'arm':<14}{'decodes':>8}{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'p99':>8}"
             f"{'goodput':>9}{'SLO met':>9}{'failed':>8}"]
    ms = lambda v: "-" if v is None else f"{v * 1000:.0f}"  # noqa: E731
    for r in doc["runs"]:
        lines.append(f"{r['arm']:<14}{r['decodes']:>8}{ms(r['ttft_p50_s']):>10}{ms(r['ttft_p99_s']):>9}"
                     f"{ms(r['tpot_p50_s']):>10}{ms(r['tpot_p99_s']):>8}{r['goodput_rps']:>9.2f}"
                     f"{r['slo_attained'] or 0:>9.1%}{r['failed']:>8}")
    for arm, row in doc["ratios"].items():
        lines.append(f"{arm} / {row['baseline']}: " + ", ".join(
            f"{k} {v:.2f}" for k, v in row.items() if k != "baseline" and v is not None))
    for name, t in doc["targets"].items():
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
        lines.append(f"target {name} {t['target']}: {ratio} {t['verdict']}")
    return "\n".join(lines)


def rss_mib(pids: list[int]) -> dict:
    """Resident memory of each process (MiB, from /proc; 0 for one gone) and their total."""
    each = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                kb = next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
        except OSError:
            kb = 0
        each.append(kb / 1024)
    return {"total": sum(each), "max": max(each, default=0.0), "processes": len(each)}


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes have used so far (from /proc; 0 for one gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return total / tick
