"""Where a server process's CPU goes, thread by thread: ``GET /debug/threads`` on the prefill and the decode.

A pdserve server runs its engine, its event loop and its CacheStore threads in one process, usually
pinned to one core, so a request's compute shares that core with the work around it (HTTP, KV sends,
checksums, streaming). ``snapshot()`` names that work: each live Python thread's name and the CPU
seconds it used since it started (from /proc), and the process's total; what the
named threads do not account for ran on threads Python did not start (torch's intra-op pool, UCX,
gRPC's core). Two snapshots around a load test give each thread's share of the core
(``docs/bench_raw/2026-11-29-peer-trace-load/tools/peer_trace_alone.py --load``).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")


def snapshot() -> dict:
    """{"process_cpu_s", "threads": [{"name", "native_id", "cpu_s"}] (most CPU first), "other_cpu_s"}.

    Each thread's user + system time is read from ``/proc/self/task/<native id>/stat`` (in clock ticks,
    10 ms here): a thread that ended meanwhile has no file and is skipped. (Not ``pthread_getcpuclockid``,
    which is undefined for a thread that ended, as a foreign thread Python saw once may have.)"""
    threads = []
    for t in threading.enumerate():
        cpu = _task_cpu_s(t.native_id)
        if cpu is not None:
            threads.append({"name": t.name, "native_id": t.native_id, "cpu_s": cpu})
    threads.sort(key=lambda row: -row["cpu_s"])
    total = time.process_time()
    return {"process_cpu_s": total, "threads": threads,
            "other_cpu_s": max(0.0, total - sum(row["cpu_s"] for row in threads))}


def _task_cpu_s(native_id: int | None) -> float | None:
    """User + system seconds of this process's thread ``native_id``; None if it is gone (or not Linux)."""
    if native_id is None:
        return None
    try:
        stat = Path(f"/proc/self/task/{native_id}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": the name may hold spaces
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime: fields 14 and 15 of proc(5)


def by_name_delta(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds per thread name between two snapshots (threads of one name summed; a thread that
    started in between counts whole), plus "(other threads)": the rest of the process's CPU, which also
    holds what a Python thread that ended in between used."""
    def sums(snap: dict) -> dict[tuple, float]:
        return {(row["name"], row["native_id"]): row["cpu_s"] for row in snap["threads"]}

    old, new = sums(before), sums(after)
    out: dict[str, float] = {}
    for key, cpu in new.items():
        out[key[0]] = out.get(key[0], 0.0) + cpu - old.get(key, 0.0)
    out["(other threads)"] = after["other_cpu_s"] - before["other_cpu_s"]
    return out
