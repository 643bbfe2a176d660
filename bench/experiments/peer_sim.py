"""The peer experiment's fidelity system, ``sim`` (``--sim-profile PATH|measure``; issue 50 item 2): pdserve's
P/D on the simulated engine (``--engine sim``), started with the same flags, cores and KV blocks as pdserve's and
alternated with it in every repeat, so the simulator is judged against the real engine on the same box, the same
requests and the same load in one invocation.

``--sim-profile measure`` measures the profile in the same invocation, right before each sim start (after the real
run of the same repeat): ``bench/sim_profile.py``'s measurement of the very checkpoint the servers load (the peer
checkpoint of ``--model-size``), pinned to the prefill's core, one thread, written to
``<out>/<name>-profile-<repeat>.json``. A box whose load changes between that minute and the runs shifts the real
engine's time but not the profile's: that is the drift this system shows, and measuring per repeat keeps it to
the minutes of one repeat.

``compare`` gives, per figure, the ratio sim / pdserve of the medians over the repeats and the ratio of each
repeat (the sim's run over pdserve's run of the same repeat); the fidelity target (issue 50: within 15%) holds on
the median ratio, and the verdict says when the repeats fall on both sides of the band.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import report
from .trace_routing_figures import pair_ratios

SIM = "sim"
REAL = "pdserve"
FIDELITY_BAND = 0.15  # issue 50: |sim / real - 1| <= 15%
# the figures judged (issue 50 item 2: TTFT p50/p99, TPOT, goodput) and those shown beside them
JUDGED = ("ttft_p50", "ttft_p99", "tpot_mean", "goodput_rps")
SHOWN = ("tpot_p50", "tpot_p99", "itl_p99", "output_tok_s")


def within(ratio: float | None, band: float = FIDELITY_BAND) -> bool | None:
    """Whether sim / real is within the band (None: no figure)."""
    return None if ratio is None else abs(ratio - 1) <= band + 1e-12


def band_verdict(ratio: float | None, pairs: list[float], band: float = FIDELITY_BAND) -> str:
    """'within 15%' / 'OUT of 15%' on the median ratio, and whether the repeats fall on both sides of the band."""
    ok = within(ratio, band)
    if ok is None:
        return "no figure"
    word = f"within {band:.0%}" if ok else f"OUT of {band:.0%}"
    sides = {within(p, band) for p in pairs}
    return word + (" (repeats on both sides of the band)" if len(sides) == 2 else "")


def compare(runs: list[dict], cells: dict) -> dict:
    """Per cell: {figure: {ratio, pairs, judged, verdict}} of sim against the real engine."""
    out = {}
    for cell, e in cells.items():
        med = e["medians"]
        if REAL not in med or SIM not in med:
            continue
        per_repeat = [{"round": r["repeat"], "arm": r["system"], **r["cells"][cell]} for r in runs
                      if cell in r["cells"] and r["system"] in (REAL, SIM)]
        figures = {}
        for name in JUDGED + SHOWN:
            if med[REAL].get(name) is None or med[SIM].get(name) is None:
                continue
            ratio = report.ratio(med[SIM][name], med[REAL][name])
            pairs = pair_ratios(per_repeat, SIM, name, baseline=REAL)
            figures[name] = {"ratio": ratio, "pairs": pairs, "judged": name in JUDGED,
                             "verdict": band_verdict(ratio, pairs)}
        out[cell] = figures
    return out


def format_compare(compared: dict) -> str:
    lines = [f"sim / pdserve (--sim-profile): median ratio [each repeat]; fidelity target within "
             f"{FIDELITY_BAND:.0%} on {', '.join(JUDGED)}"]
    for cell, figures in compared.items():
        for name, row in figures.items():
            ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
            pairs = ", ".join(f"{p:.2f}" for p in row["pairs"])
            tag = "" if row["judged"] else " (shown)"
            lines.append(f"{cell:<18}{name:<14}{ratio:>6} [{pairs}]  {row['verdict']}{tag}")
    return "\n".join(lines)


def measure_profile(model: str, out: Path, cpu: str, say=print) -> Path:
    """Measure the checkpoint ``model`` (a directory) here, pinned to ``cpu``, one thread; the profile's path."""
    import argparse

    from pdserve.bench import sim_profile

    parser = argparse.ArgumentParser()
    sim_profile.add_arguments(parser)
    args = parser.parse_args(["--out", str(out), "--model", model, "--threads", "1"])
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {int(c) for c in cpu.split(",")})
    try:
        say(f"measuring the sim profile of {model} on CPU {cpu} (load {os.getloadavg()[0]:.2f})")
        sim_profile.run(args)
    finally:
        os.sched_setaffinity(0, before)
    return out
