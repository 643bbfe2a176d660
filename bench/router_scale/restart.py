"""A router killed (SIGKILL) and started again under load, its prefills holding the index's full size.

The load keeps going to the router's address. What requests see: until the new process listens,
connection errors; once it listens and a load report came in (/ready), requests are routed by load
alone (decision reason ``balance``) until each prefill's snapshot is applied; then by prefix again.
Nothing of the KV events should be lost for good: each new subscription starts with the prefill's snapshot
(``protos/kv_events.proto``), so the rebuilt index is the prefills' state as of that snapshot, and the
events after it follow. Measured: once the load is over, ``index_agreement`` compares the new router's
entry of every stand-in (epoch, last seq, blocks) with the stand-in's own (its GET /state).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

from .client import Result, send_all, summary
from .serving import Setup, cpu_seconds


def restart_under_load(setup: Setup, bodies: list[bytes], arrivals: list[float], kill_at_s: float) -> dict:
    port = int(setup.router_url.rsplit(":", 1)[1])
    results: list[Result] = []
    t_start = time.perf_counter()

    def load():
        results.extend(asyncio.run(send_all([setup.router_url], bodies, arrivals)))

    th = threading.Thread(target=load, name="restart load")
    th.start()
    time.sleep(kill_at_s)
    old = setup.router
    t_kill = time.perf_counter()
    os.killpg(old.popen.pid, signal.SIGKILL)
    old.popen.wait(timeout=30)
    fleet0 = cpu_seconds(setup.fleet.popen.pid)
    times = setup.start_router(name="router-restarted", port=port)
    fleet_cpu = cpu_seconds(setup.fleet.popen.pid) - fleet0
    th.join()
    wall = time.perf_counter() - t_start
    ready_at = t_kill + times["ready_s"]
    synced_at = t_kill + times["synced_s"]

    def phase(r: Result) -> str:
        if r.start < t_kill:
            return "before_kill"
        if r.start < ready_at:
            return "until_ready"
        if r.start < synced_at:
            return "until_index_rebuilt"
        return "after"

    phases: dict[str, list[Result]] = {}
    for r in results:
        phases.setdefault(phase(r), []).append(r)
    out = {"kill_at_s": kill_at_s, "restart": times, "wall_s": wall, "fleet_cpu_s": fleet_cpu,
           "phases": {k: summary(v, wall) for k, v in phases.items()},
           "router_after": setup.metrics(), "index_after": setup.index_agreement()}
    return out
