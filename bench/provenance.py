"""Where a measurement ran, and figures that say so.

``machine()`` is the record every experiment's JSON carries (CPU model and count, memory, kernel,
Python, commit, load average at the start, UTC time). ``save_figure`` writes a matplotlib figure
with that record stamped along its bottom edge (CPU model, CPUs, UTC date, commit), so a plot cut
out of docs/ still names the machine and the day it was measured on (issue 33 item 5). A figure
re-rendered from a committed JSON passes that JSON's ``machine``: the stamp names the run, not the
machine that drew it.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

STAMP_STRIP = 0.035  # fraction of the figure's height kept free for the stamp


def machine() -> dict:
    """Where the experiment ran (for docs/benchmarks.md)."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parents[1], timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "mem_gib": round(mem_gib, 1) if mem_gib else None,
            "kernel": platform.release(), "python": platform.python_version(), "git_commit": commit,
            "load_avg_at_start": os.getloadavg(), "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


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
