"""Where a measurement ran, written into every result and figure the bench package makes.

``run_start()`` is the record of this run, taken once, when it starts (``pdserve bench`` takes it before
the benchmark parses its options): CPU model (``lscpu``'s model name, else /proc/cpuinfo) and count,
memory, kernel, Python, the tree's git commit and whether the tree was dirty, the load average, UTC
time. ``write_json`` is the one place the package writes a result: the document with that record as its
``provenance`` (a file over ``GZIP_ABOVE_BYTES`` is written gzip-compressed, ``NAME.json.gz``), so
every JSON says where and on what its run began, not where it ended (issue 52 item 4). ``machine()`` is
the same record taken now.

``save_figure`` writes a matplotlib figure with a record stamped along its bottom edge (CPU model,
CPUs, UTC date, commit), so a plot cut out of docs/ still names the machine and the day it was
measured on (issue 33 item 5). A figure re-rendered from a committed JSON passes that JSON's record:
the stamp names the run, not the machine that drew it.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import platform
import subprocess
import time
from pathlib import Path

STAMP_STRIP = 0.035  # fraction of the figure's height kept free for the stamp
GZIP_ABOVE_BYTES = 4 * 2**20  # a result JSON larger than this (per-request records of a long run) is gzipped
REPO = Path(__file__).resolve().parents[1]  # the checkout this package runs from (git asks it)


def cpu_model() -> str:
    """``lscpu``'s model name, else /proc/cpuinfo's first ``model name``; "" where neither says."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _git(*argv: str) -> str | None:
    try:
        done = subprocess.run(["git", *argv], capture_output=True, text=True, cwd=REPO, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def git_state() -> tuple[str, bool | None]:
    """The tree's commit (short) and whether tracked files differ from it; ("", None) outside a checkout."""
    commit = (_git("rev-parse", "--short", "HEAD") or "").strip()
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return commit, (None if status is None else bool(status.strip()))


def machine() -> dict:
    """Where and on what this process runs, now (for docs/benchmarks.md)."""
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = None
    commit, dirty = git_state()
    return {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "mem_gib": round(mem_gib, 1) if mem_gib else None,
            "kernel": platform.release(), "python": platform.python_version(), "git_commit": commit,
            "git_dirty": dirty, "load_avg": list(os.getloadavg()),
            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


@functools.cache
def run_start() -> dict:
    """The ``machine()`` record of this run, taken once, at the first call: ``pdserve bench`` makes that call
    before the benchmark starts, and a benchmark run as a script (``python -m ...``) at its own start."""
    return {**machine(), "taken": "at the start of the run"}


def write_json(path: Path | str, doc: dict) -> Path:
    """The one writer of a result: ``doc`` after a ``provenance`` record of the run's start, to ``path`` (its
    folder made), or to ``path`` + ``.gz`` when the text exceeds ``GZIP_ABOVE_BYTES``; returns the path written.
    A run that never called ``run_start()`` gets the record of now, and the record says so."""
    record = run_start() if run_start.cache_info().currsize else {
        **machine(), "taken": "when the result was written (the run did not record its start)"}
    text = json.dumps({"provenance": record, **doc}, indent=1, default=str)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if len(text) > GZIP_ABOVE_BYTES:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def stamp(record: dict) -> str:
    """One line naming a ``machine()`` record: CPU model (CPUs), UTC date, commit; missing parts left out."""
    cpu = record.get("cpu_model") or "CPU not recorded"
    if record.get("cpus"):
        cpu += f" ({record['cpus']} CPUs)"
    parts = [cpu, (record.get("utc") or "")[:10], f"commit {record['git_commit']}" if record.get("git_commit") else ""]
    return " · ".join(p for p in parts if p)


def save_figure(fig, path, record: dict | None = None, dpi: int = 100) -> Path:
    """Lay ``fig`` out, stamp it with ``record`` (default: this machine now), write it to ``path`` (its folder
    made), close it; returns the path."""
    fig.tight_layout(rect=(0, STAMP_STRIP, 1, 1))
    fig.text(0.995, 0.006, stamp(record if record is not None else machine()), ha="right", va="bottom",
             fontsize=7, color="dimgrey")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
