"""The compressed day's figure (``scale_day.py``): per day arm over the day, the pods running and the SLO
attainment per part of the day, above the arrival rate the arms shared."""

from __future__ import annotations

from pathlib import Path

from ..provenance import save_figure
from . import report

COLORS = {"day-planner": "tab:blue", "day-peak": "tab:red", "day-mean": "tab:green"}


def plot(runs: list[dict], path: Path, speedup: float) -> Path | None:
    """Three panels, x in simulated seconds of the day; None when no day arm ran."""
    days = [r for r in runs if r["arm"] in COLORS]
    if not days:
        return None
    plt = report.pyplot()
    fig, (rate, pods, met) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    first = days[0]["timeline"]
    width = (first[1]["from_s"] - first[0]["from_s"]) if len(first) > 1 else 1.0
    rate.bar([(b["from_s"] + width / 2) * speedup for b in first], [b["rps"] / speedup for b in first],
             width=width * speedup * 0.9, color="grey")
    rate.set_ylabel("requests/s sent")
    rate.set_title("the compressed day: arrivals, pods, SLO attainment")
    for i, r in enumerate(days):
        color, label = COLORS[r["arm"]], f"{r['arm']} ({r['pod_seconds']['total']:.0f} pod-s)"
        ts = [t * speedup for t, _, _ in r["pods_over_time"]]
        pods.step(ts, [p + d for _, p, d in r["pods_over_time"]], where="post", color=color, label=label,
                  linestyle=("-", "--", ":")[i % 3])
        met.plot([(b["from_s"] + width / 2) * speedup for b in r["timeline"]],
                 [b["slo_attained"] for b in r["timeline"]], marker="o", color=color, label=r["arm"])
    pods.set_ylabel("prefill + decode pods")
    pods.legend()
    met.set_ylabel("share meeting the SLO")
    met.set_ylim(0, 1.05)
    met.set_xlabel("simulated seconds into the day")
    met.legend()
    for ax in (rate, pods, met):
        ax.grid(True, alpha=0.3)
    return save_figure(fig, path)
