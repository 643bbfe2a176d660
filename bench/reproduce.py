"""Rerun a row of docs/results.md and print its new figure beside the published one.

    pdserve bench reproduce --list                 # the rows: id, area, published figure
    pdserve bench reproduce ROW [--out DIR]        # run the row's command, then published vs new
    pdserve bench reproduce ROW --dry-run          # print the command only
    pdserve bench reproduce --tables               # the tables of docs/results.md, from the rows

The rows live in results_rows.py. A row's command names ``OUT``: it becomes ``--out`` (default
bench-results/reproduce/ROW). ``pdserve`` in a command runs as ``python -m pdserve.cli`` and ``python`` as
this interpreter, from the repository root. What the command prints is kept in OUT/printed.txt. The new
figure is read by the row's reader (``FIGURE_READERS``): from the JSON the command wrote where the row's
figure is one, else the last lines of what it printed, to read beside the published figure.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from .provenance import REPO, run_start, stamp
from .results_rows import ROWS, ResultRow, row, tables

TAIL_LINES = 25


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("row", nargs="?", help="the row's id (see --list)")
    parser.add_argument("--list", action="store_true", help="list the rows and exit")
    parser.add_argument("--tables", action="store_true",
                        help="print docs/results.md's tables as the rows make them (paste below its introduction)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default bench-results/reproduce/ROW)")
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")


def argv_of(r: ResultRow, out: Path) -> list[str]:
    """The row's command as an argv: OUT replaced, ``pdserve`` and ``python`` this interpreter's."""
    argv = [a.replace("OUT", str(out)) for a in shlex.split(r.command)]
    if argv[0] == "pdserve":
        return [sys.executable, "-m", "pdserve.cli", *argv[1:]]
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    return argv


def _goodput(out: Path) -> str:
    g = json.loads((out / "peer-trace.json").read_text())["goodput"]
    pairs = ", ".join(f"{x:.2f}" for x in g["ratios_per_repeat"])
    return f"{g['ratio']:.2f}x (pairs {pairs}); {g['verdict']}"


def _ttft(out: Path) -> str:
    r = json.loads((out / "peer-trace.json").read_text())["goodput"]["ttft_tpot_ratios"]
    return f"TTFT p50 / p99 {r['ttft_p50']:.2f} / {r['ttft_p99']:.2f}; TPOT p99 {r['tpot_p99']:.2f}"


def _routing(out: Path) -> str:
    arms = json.loads((out / "trace_routing.json").read_text())["figures"]["arms"]
    p, rr = arms["prefix"], arms["round-robin"]
    return (f"prompt tokens computed {p['prefill_tokens_computed'] / rr['prefill_tokens_computed']:.2f}x, "
            f"goodput {p['goodput_rps'] / rr['goodput_rps']:.2f}x, "
            f"P99 TTFT {p['ttft_p99_ms'] / rr['ttft_p99_ms']:.2f}x")


def _scale_day(out: Path) -> str:
    doc = json.loads((out / "day.json").read_text())
    arms = {r["arm"]: r for r in doc["runs"]}
    plan, peak = arms["day-planner"], arms["day-peak"]
    return (f"pod-seconds {plan['pod_seconds']['total'] / peak['pod_seconds']['total']:.2f}x peak sizing; "
            f"SLO met {plan['slo_attained']:.3f} vs {peak['slo_attained']:.3f}; "
            f"{doc['day_verdict']['target']['verdict']}")


def _scale_routing(out: Path) -> str:
    doc = json.loads((out / "scale.json").read_text())
    p = doc["ratios"]["prefix"]
    return (f"P99 TTFT {p['ttft_p99_s']:.2f}x, goodput {p['goodput_rps']:.2f}x round robin; "
            + ", ".join(f"{k} {t['verdict']}" for k, t in doc["targets"].items()))


def _printed(out: Path) -> str:
    lines = (out / "printed.txt").read_text().splitlines()
    return "the last lines it printed (the figure is among them):\n  " + "\n  ".join(lines[-TAIL_LINES:])


FIGURE_READERS = {"peer_goodput": _goodput, "peer_ttft": _ttft, "trace_routing": _routing, "scale_day": _scale_day,
                  "scale_routing": _scale_routing, "printed": _printed}


def list_rows() -> str:
    return "\n".join(f"{r.id:<28} {r.area:<16} {r.figure}" for r in ROWS)


def reproduce(r: ResultRow, out: Path, dry_run: bool = False) -> int:
    argv = argv_of(r, out)
    print(f"row {r.id} ({r.area}): {r.what}\ncommand: {shlex.join(argv)}", flush=True)
    if dry_run:
        return 0
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "printed.txt", "w") as printed:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            sys.stdout.write(line)
            printed.write(line)
        rc = proc.wait()
    print(f"\npublished: {r.figure} ({r.date}; {r.machine}; commit {r.commit}; raw {r.raw})")
    print(f"this run:  {stamp(run_start())}, load at start {run_start()['load_avg'][0]:.1f}")
    if rc != 0:
        print(f"new:       none: the command exited {rc} (its output is in {out / 'printed.txt'})")
        return rc
    try:
        print(f"new:       {FIGURE_READERS[r.reads](out)}")
    except (OSError, KeyError, ValueError, ZeroDivisionError) as e:
        print(f"new:       not read ({e!r}); {FIGURE_READERS['printed'](out)}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.list or args.tables:
        print(list_rows() if args.list else tables(), end="\n" if args.list else "")
        return 0
    if not args.row:
        print("pdserve bench reproduce: give a row's id, or --list", file=sys.stderr)
        return 2
    try:
        r = row(args.row)
    except KeyError as e:
        print(f"pdserve bench reproduce: {e.args[0]}", file=sys.stderr)
        return 2
    return reproduce(r, (args.out or Path("bench-results/reproduce") / r.id).resolve(), args.dry_run)
