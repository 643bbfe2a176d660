"""The chaos bench's figures: summary, the printed table, the JSON document and the PNG.

Summary fields: counts per outcome (completed, failed, cut, hung, wrong), ``leaked`` (number
of servers holding anything at the end), ``completed_pct`` over all requests, and
``completed_pct_serving``: over the requests whose lifetime met no prefill outage (a
killed prefill was down or restarting; a paused prefill counts as serving) and during which
at least one decode served (the chaos loop never takes the last one).

The target (``verdict``): 0 cut, 0 hung, 0 wrong, 0 leaked and at least ``TARGET_PCT`` completed
over EVERY request sent, when two or more prefills sit behind the router (a stream whose prefill
dies is resumed on another). With one prefill there is no router: the prefill is the front door,
and its death ends the streams it fronts, so there the rate is over the requests that met no
prefill outage, labelled as such. The table leads with the rate over every request either way.
"""

from __future__ import annotations

from pathlib import Path

from ..provenance import save_figure
from .faults import Fault
from .outcome import OUTCOMES, RequestRecord, counts, overlaps

COLORS = {"completed": "tab:green", "failed": "tab:orange", "cut": "tab:purple", "hung": "tab:red", "wrong": "black"}
FAULT_COLORS = {"kill-decode": "tab:red", "stop-decode": "tab:blue", "kill-prefill": "darkred", "stop-prefill": "navy",
                "netem": "tab:olive"}


def summarize(records: list[RequestRecord], faults: list[Fault], leaked: dict, horizon: float) -> dict:
    c = counts(records)
    prefill_down = [f.outage(horizon) for f in faults if f.kind == "kill-prefill"]
    serving = [r for r in records if not overlaps(r, prefill_down)]
    done = sum(r.outcome == "completed" for r in serving)
    return {
        "requests": len(records), **c, "leaked": len(leaked),
        "completed_pct": 100.0 * c["completed"] / len(records) if records else 0.0,
        "requests_while_serving": len(serving),
        "completed_pct_serving": 100.0 * done / len(serving) if serving else 0.0,
        "faults": {k: sum(f.kind == k for f in faults) for k in sorted({f.kind for f in faults})},
        "errors": _error_kinds(records),
    }


TARGET_PCT = 99.9


def verdict(s: dict, prefills: int, leaked: bool) -> tuple[bool, str]:
    """(target met, one line saying which target and why)."""
    over_all = prefills >= 2
    rate, label = ((s["completed_pct"], "of every request sent") if over_all else
                   (s["completed_pct_serving"], "of the requests that met no prefill outage (one prefill: no router)"))
    misses = [f"{k} {s[k]}" for k in ("cut", "hung", "wrong") if s[k]] + (["leaked"] if leaked else [])
    if rate < TARGET_PCT:
        misses.append(f"{rate:.2f}% completed {label} < {TARGET_PCT}%")
    ok = not misses
    return ok, (f"target met: {rate:.2f}% completed {label}, 0 cut, 0 hung, 0 wrong, 0 leaked" if ok
                else "target missed: " + "; ".join(misses))


def _error_kinds(records: list[RequestRecord]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        if r.outcome != "completed" and r.error:
            key = r.error[:90]
            out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:15])


def format_table(s: dict, transfer: str) -> str:
    head = (f"{'transfer':<9}{'requests':>9}" + "".join(f"{o:>10}" for o in OUTCOMES)
            + f"{'leaked':>8}{'%done':>8}{'%done*':>8}")
    row = (f"{transfer:<9}{s['requests']:>9}" + "".join(f"{s[o]:>10}" for o in OUTCOMES)
           + f"{s['leaked']:>8}{s['completed_pct']:>8.1f}{s['completed_pct_serving']:>8.1f}")
    return (f"{head}\n{row}\n(%done: of all {s['requests']} requests sent; %done*: of the "
            f"{s['requests_while_serving']} that met no prefill outage)\n"
            f"faults: {s['faults']}")


def plot(records: list[RequestRecord], faults: list[Fault], path: Path, title: str, bin_s: float = 5.0) -> Path:
    """Top: every request as a line from send to end, coloured by outcome; faults as vertical
    lines. Bottom: outcomes per bin of send time (stacked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(14, 8), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for r in records:
        top.plot([r.start, r.end if r.end is not None else r.start], [r.index, r.index], color=COLORS[r.outcome],
                 lw=1.0 if r.outcome == "completed" else 2.0)
    for ax in (top, bottom):
        for f in faults:
            ax.axvline(f.time, color=FAULT_COLORS.get(f.kind, "gray"), ls="--", lw=0.8, alpha=0.8)
            if f.recovered_at is not None and ax is top:
                ax.axvspan(f.time, f.recovered_at, color=FAULT_COLORS.get(f.kind, "gray"), alpha=0.08)
    for f in faults:
        top.text(f.time, 1.0, f"{f.kind} {f.target}", rotation=90, va="top", ha="right", fontsize=6,
                 transform=top.get_xaxis_transform())
    for o in OUTCOMES:
        top.plot([], [], color=COLORS[o], label=o)
    top.legend(loc="lower right", fontsize=8)
    top.set_ylabel("request")
    top.set_title("requests (send -> end) and faults (dashed: injected; shaded: until recovered)", fontsize=9)
    horizon = max([r.end or 0 for r in records] + [1.0])
    nbins = int(horizon // bin_s) + 1
    bottom_acc = [0] * nbins
    xs = [i * bin_s for i in range(nbins)]
    for o in OUTCOMES:
        ys = [0] * nbins
        for r in records:
            if r.outcome == o:
                ys[int(r.start // bin_s)] += 1
        bottom.bar(xs, ys, width=bin_s * 0.9, bottom=bottom_acc, color=COLORS[o], align="edge")
        bottom_acc = [a + b for a, b in zip(bottom_acc, ys)]
    bottom.set_xlabel("time since start (s)")
    bottom.set_ylabel(f"requests / {bin_s:.0f}s")
    fig.suptitle(title)
    return save_figure(fig, path)
