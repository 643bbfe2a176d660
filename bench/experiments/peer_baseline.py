"""The peer experiment's third system, ``baseline`` (``--baseline-tree DIR``): pdserve from another checkout,
run with the same flags and alternated with pdserve (and vLLM) in every repeat, so a change to pdserve is
judged against the tree before it on the same box in the same invocation.

``compare`` gives, per figure, the ratio pdserve / baseline of the medians over the repeats and the ratio of
each repeat (pdserve's run over the baseline's of the same repeat); a verdict holds only when every repeat
falls on its side (``verdict``: "pairs on both sides" otherwise).
"""

from __future__ import annotations

from . import report
from .peer_trace import TRACE_CELL
from .trace_routing_figures import pair_ratios, verdict

# figure -> which way is better for pdserve
FIGURES = {"ttft_p50": "lower", "ttft_p99": "lower", "tpot_mean": "lower", "tpot_p99": "lower",
           "itl_p99": "lower", "output_tok_s": "higher", "goodput_rps": "higher"}
# the targets an issue states against the tree before it, per cell (issue 46: TTFT p99 <= 0.7x on the trace;
# a grid cell has none: there a change is judged "within noise or better" from the pairs)
TARGETS = {TRACE_CELL: {"ttft_p99": 0.7}}


def compare(runs: list[dict], cells: dict) -> dict:
    """Per cell: {figure: {ratio, pairs, verdict (when a target)}} of pdserve against the baseline."""
    out = {}
    for cell, e in cells.items():
        med = e["medians"]
        if "pdserve" not in med or "baseline" not in med:
            continue
        per_repeat = [{"round": r["repeat"], "arm": r["system"], **r["cells"][cell]} for r in runs
                      if cell in r["cells"] and r["system"] in ("pdserve", "baseline")]
        figures = {}
        for name, better in FIGURES.items():
            if name not in med["pdserve"] or name not in med["baseline"]:
                continue
            ratio = report.ratio(med["pdserve"][name], med["baseline"][name])
            pairs = pair_ratios(per_repeat, "pdserve", name, baseline="baseline")
            row = {"ratio": ratio, "pairs": pairs, "better": better}
            target = TARGETS.get(cell, {}).get(name)
            if target is not None:
                row["target"] = target
                row["verdict"] = verdict(ratio, pairs, target, better)
            figures[name] = row
        out[cell] = figures
    return out


def format_compare(compared: dict) -> str:
    """One line per cell and figure: the median ratio, each repeat's, the verdict where a target."""
    lines = ["pdserve / baseline (--baseline-tree): median ratio [each repeat]"]
    for cell, figures in compared.items():
        for name, row in figures.items():
            ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
            pairs = ", ".join(f"{p:.2f}" for p in row["pairs"])
            judged = f"  target {'<=' if row['better'] == 'lower' else '>='} {row['target']:g}: {row['verdict']}" \
                if "verdict" in row else ""
            lines.append(f"{cell:<18}{name:<14}{ratio:>6} [{pairs}]{judged}")
    return "\n".join(lines)
