"""What the peer experiment reports: per-run figures, medians over repeats, ratios, targets, plot.

Ratios are pdserve / vLLM P/D of the medians over the repeats (below 1 is better for pdserve
on latencies, above 1 on throughput). The targets are issue 16's.

A run measured under an SLO (the trace cell, peer_trace.py) also carries goodput (``goodput_rps``:
requests meeting both the TTFT and the mean-time-between-tokens bound, per second of the run;
DistServe's measure, ``loadgen_report.summarize``) and ``slo_attained``; ``goodput_verdict`` judges
issue 33's target for it, pdserve's goodput >= vLLM P/D's, beside the TTFT and TPOT ratios.
"""

from __future__ import annotations

import statistics

from pdserve.bench.loadgen_report import RequestResult, percentile

from . import report
from .trace_routing_figures import pair_ratios, verdict

SYSTEMS = ("pdserve", "vllm")  # the pair the targets compare
RUN_SYSTEMS = ("pdserve", "baseline", "sim", "vllm")  # what a run may hold (baseline: --baseline-tree,
# peer_baseline.py; sim: --sim-profile, peer_sim.py)
# figure -> (summary key, field); "failed" and throughput are top-level numbers of the summary
FIGURES = {
    "ttft_mean": ("ttft_s", "mean"), "ttft_p50": ("ttft_s", "p50"), "ttft_p99": ("ttft_s", "p99"),
    "tpot_mean": ("tpot_s", "mean"), "tpot_p50": ("tpot_s", "p50"), "tpot_p99": ("tpot_s", "p99"),
    "itl_mean": ("tbt_s", "mean"), "itl_p50": ("tbt_s", "p50"), "itl_p99": ("tbt_s", "p99"),
    "output_tok_s": ("output_token_throughput", None), "failed": ("failed", None),
}
# figure -> (comparison, ratio): pdserve / vLLM must be <= (or >=) the ratio
TARGETS = {"ttft_mean": ("<=", 0.8), "tpot_mean": ("<=", 1.0), "itl_p99": ("<=", 1.0), "output_tok_s": (">=", 1.0)}
SLO_FIGURES = ("goodput_rps", "slo_attained")  # in the figures of runs measured under an SLO only
GOODPUT_TARGET = 1.0  # issue 33: pdserve's goodput on the trace >= vLLM P/D's
CDF_POINTS = 100


def cell_name(prompt: int, output: int, rate: float) -> str:
    return f"p{prompt}-o{output}-r{rate:g}"


def run_figures(summary: dict, results: list[RequestResult]) -> dict:
    """One run of one cell: the figures, TTFT and ITL quantiles for the plot, and every request's record."""
    out = {}
    for name, (key, field) in FIGURES.items():
        value = summary[key] if field is None else summary[key][field]
        out[name] = value
    good = [r for r in results if r.ok]
    slo = summary.get("slo") or {}
    if slo.get("ttft_s") is not None or slo.get("tbt_s") is not None:  # measured under an SLO: goodput counts
        out["goodput_rps"], out["slo_attained"], out["slo"] = summary["goodput"], summary["slo_attained"], slo
    out["requests"] = summary["requests"]
    out["errors"] = summary["errors"]
    examples: dict[str, str] = {}
    for r in results:
        if not r.ok:
            examples.setdefault(r.error.split(":", 1)[0][:80] or "unknown", r.error[:400])
    out["error_examples"] = examples  # the first full message of each kind
    out["per_request"] = [r.to_json() for r in results]  # the raw records the figures come from (issue 52 item 4)
    out["ttft_quantiles"] = _quantiles([r.ttft for r in good if r.ttft is not None])
    out["itl_quantiles"] = _quantiles([g for r in good for g in r.gaps])
    return out


def _quantiles(values: list[float]) -> list[float]:
    if not values:
        return []
    return [percentile(values, 100 * i / (CDF_POINTS - 1)) for i in range(CDF_POINTS)]


def aggregate(runs: list[dict]) -> dict:
    """runs: {"system", "repeat", "cells": {cell: figures}} -> per cell: medians per system, ratios, targets."""
    cells = sorted({c for r in runs for c in r["cells"]}, key=_cell_key)
    out = {}
    for cell in cells:
        medians = {}
        for system in RUN_SYSTEMS:
            per = [r["cells"][cell] for r in runs if r["system"] == system and cell in r["cells"]]
            if not per:
                continue
            names = [n for n in FIGURES if n != "failed"] + [n for n in SLO_FIGURES if all(n in p for p in per)]
            m = {name: _median([p[name] for p in per]) for name in names}
            m["failed"] = sum(p["failed"] for p in per)
            m["requests"] = sum(p["requests"] for p in per)
            m["repeats"] = len(per)
            medians[system] = m
        entry = {"medians": medians}
        if all(s in medians for s in SYSTEMS):
            ratios = {name: report.ratio(medians["pdserve"][name], medians["vllm"][name])
                      for name in medians["pdserve"] if name in medians["vllm"] and name not in ("failed", "requests",
                                                                                                  "repeats")}
            met = {name: _meets(ratios[name], *TARGETS[name]) for name in TARGETS}
            met["failed"] = medians["pdserve"]["failed"] == 0
            entry.update(ratios=ratios, met=met, all_met=all(met.values()))
        out[cell] = entry
    return out


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _meets(ratio: float | None, op: str, target: float) -> bool:
    if ratio is None:
        return False
    return ratio <= target if op == "<=" else ratio >= target


def _cell_key(cell: str) -> tuple:
    """Grid cells by prompt, output, rate; any other cell (the trace's) after them, by name."""
    try:
        p, o, r = cell.split("-")
        return 0, int(p[1:]), int(o[1:]), float(r[1:])
    except ValueError:
        return 1, cell


def goodput_verdict(runs: list[dict], cells: dict, cell: str) -> dict:
    """Issue 33's target on one cell measured under an SLO: pdserve's median goodput >= vLLM P/D's.

    Also the goodput ratio of each repeat (pdserve's over vLLM's of the same repeat; the verdict says when
    they fall on both sides of the target) and the TTFT and TPOT ratios of the medians."""
    e = cells[cell]
    med = e["medians"]
    if not all(s in med and "goodput_rps" in med[s] for s in SYSTEMS):
        return {"verdict": "no figure (a system has no run measured under an SLO)"}
    good = {s: med[s]["goodput_rps"] for s in SYSTEMS}
    per_repeat = [{"round": r["repeat"], "arm": r["system"], "goodput_rps": r["cells"][cell]["goodput_rps"]}
                  for r in runs if cell in r["cells"]]
    pairs = pair_ratios(per_repeat, "pdserve", "goodput_rps", baseline="vllm")
    ratio = e["ratios"].get("goodput_rps")
    if good["vllm"] == 0:  # no ratio: judge the target itself
        word = "no request met the SLO on either system" if good["pdserve"] == 0 else "met (vLLM P/D's goodput is 0)"
    else:
        word = verdict(ratio, pairs, GOODPUT_TARGET, "higher")
    keys = ("ttft_mean", "ttft_p50", "ttft_p99", "tpot_mean", "tpot_p50", "tpot_p99")
    return {"target": f"goodput pdserve / vLLM P/D >= {GOODPUT_TARGET:g}", "goodput_rps": good, "ratio": ratio,
            "ratios_per_repeat": pairs, "verdict": word,
            "slo_attained": {s: med[s].get("slo_attained") for s in SYSTEMS},
            "ttft_tpot_ratios": {k: e["ratios"].get(k) for k in keys}}


def format_goodput(v: dict, slo: str) -> str:
    """Two lines: goodput of both systems under the SLO with the verdict, then the TTFT and TPOT ratios."""
    if "goodput_rps" not in v:
        return f"goodput: {v['verdict']}"
    g, r = v["goodput_rps"], v["ttft_tpot_ratios"]
    ratio = "-" if v["ratio"] is None else f"{v['ratio']:.2f}"

    def x(k):
        return "-" if r[k] is None else f"{r[k]:.2f}"
    return (f"goodput ({slo}): pdserve {g['pdserve']:.2f} req/s, vLLM P/D {g['vllm']:.2f} req/s, ratio {ratio} "
            f"[target >= {GOODPUT_TARGET:g}]: {v['verdict']}\n"
            f"pdserve / vLLM P/D: TTFT mean {x('ttft_mean')} p50 {x('ttft_p50')} p99 {x('ttft_p99')}; "
            f"TPOT mean {x('tpot_mean')} p50 {x('tpot_p50')} p99 {x('tpot_p99')}")


def format_table(cells: dict) -> str:
    """Medians (ms, tok/s) per system and the ratios with their targets, one line per cell and system."""
    def ms(v):
        return "-" if v is None else f"{v * 1000:.1f}"

    head = (f"{'cell':<18}{'system':<9}{'TTFT mean':>10}{'p99':>9}{'TPOT mean':>10}{'p99':>8}"
            f"{'ITL p50':>9}{'p99':>8}{'tok/s':>8}{'failed':>9}")
    lines = [head]
    for cell, e in cells.items():
        for system, m in e["medians"].items():
            lines.append(f"{cell:<18}{system:<9}{ms(m['ttft_mean']):>10}{ms(m['ttft_p99']):>9}{ms(m['tpot_mean']):>10}"
                         f"{ms(m['tpot_p99']):>8}{ms(m['itl_p50']):>9}{ms(m['itl_p99']):>8}"
                         f"{m['output_tok_s']:>8.1f}{m['failed']:>5}/{m['requests']:<3}")
    lines.append("")
    lines.append("ratios pdserve / vLLM P/D (medians over repeats); target in brackets")
    lines.append(f"{'cell':<18}" + "".join(f"{n + ' ' + op + format(t, 'g'):>20}" for n, (op, t) in TARGETS.items())
                 + f"{'pdserve failed':>16}")
    for cell, e in cells.items():
        if "ratios" not in e:
            continue
        row = f"{cell:<18}"
        for name in TARGETS:
            r = e["ratios"][name]
            row += f"{('-' if r is None else f'{r:.2f}') + (' ok' if e['met'][name] else ' MISS'):>20}"
        row += f"{e['medians']['pdserve']['failed']:>12} {'ok' if e['met']['failed'] else 'MISS'}"
        lines.append(row)
    return "\n".join(lines)


def plot(runs: list[dict], cells: dict, path, title: str):
    """Ratio bars per cell (with the targets), and CDFs of TTFT and ITL per system and cell."""
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    names = list(cells)
    width = 0.8 / len(TARGETS)
    ax = axes[0]
    for i, (metric, (op, target)) in enumerate(TARGETS.items()):
        xs = [j + (i - (len(TARGETS) - 1) / 2) * width for j in range(len(names))]
        ys = [(cells[c].get("ratios") or {}).get(metric) or 0 for c in names]
        bars = ax.bar(xs, ys, width, label=f"{metric} (target {op} {target:g})")
        ax.hlines([target] * len(xs), [x - width / 2 for x in xs], [x + width / 2 for x in xs],
                  colors=bars.patches[0].get_facecolor() if bars.patches else "k", linestyles="--")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    ax.set_ylabel("pdserve / vLLM P/D (medians over repeats)")
    ax.set_title("ratios (dashes: targets)")
    ax.legend(fontsize=7)
    styles = ["-", "--", ":", "-."]
    for ax, key, label in ((axes[1], "ttft_quantiles", "TTFT"), (axes[2], "itl_quantiles", "ITL")):
        for j, cell in enumerate(names):
            for system, color in zip(RUN_SYSTEMS, ("tab:blue", "tab:green", "tab:purple", "tab:orange")):
                qs = [q for r in runs if r["system"] == system and cell in r["cells"]
                      for q in r["cells"][cell][key]]
                if qs:
                    m = cells[cell]["medians"][system]
                    report.cdf(ax, qs, f"{system} {cell} ({m['failed']}/{m['requests']} failed)")
                    ax.lines[-1].set(color=color, linestyle=styles[j % len(styles)])
        ax.set_xscale("log")
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("fraction")
        ax.set_title(f"CDF of {label} (all repeats)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    return report.save_figure(fig, path)
