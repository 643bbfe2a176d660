"""One router process, pinned to one CPU, in front of a fleet of stand-in prefills (``fleet.py``).

``Setup`` starts the fleet (one process, ``fleet_cpus``) and ``pdserve router`` (``router_cpus``,
``--prefill`` every stand-in's gRPC address), waits until the router's index holds every stand-in's
blocks (its /health), and can restart the router (``restart_router``). ``window`` sends one load
(``client.send_all``, from this process: pin it with ``os.sched_setaffinity``) either through the
router or straight to the stand-ins, and reads the router's CPU seconds (``/proc/PID/stat``) over it.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from dataclasses import dataclass, field

from pdserve.bench.experiments.launcher import Launcher, Proc, metric_sum, scrape
from pdserve.net import free_port

from .client import send_all, summary

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096


@dataclass
class Setup:
    launcher: Launcher
    count: int
    capacity: int
    preload: int
    router_cpus: str = "0"
    fleet_cpus: str = "1"
    prefill_s: float = 0.0
    itl_s: float = 0.0
    evictions: str = "batched"  # how the stand-ins publish evictions (fleet.EVICTIONS)
    nice: int = 0  # the fleet's and the router's niceness (the box is shared: a lower one keeps them scheduled)
    grpc: list[str] = field(default_factory=list)
    http: list[str] = field(default_factory=list)
    fleet: Proc | None = None
    router: Proc | None = None
    router_url: str = ""

    def start_fleet(self, timeout: float = 600.0) -> None:
        import sys

        spec = json.dumps({"count": self.count, "capacity": self.capacity, "preload": self.preload,
                           "prefill_s": self.prefill_s, "itl_s": self.itl_s, "evictions": self.evictions})
        cmd = [*self._nice(), sys.executable, "-u", "-m", "pdserve.bench.router_scale.fleet", spec]
        self.fleet = self.launcher.spawn(f"fleet-{self.count}-{self.evictions}", cmd, cpus=self.fleet_cpus)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.fleet.popen.poll() is not None:
                raise RuntimeError(f"the fleet exited: {self.fleet.log.read_text()[-3000:]}")
            for line in self.fleet.log.read_text(errors="replace").splitlines():
                if line.startswith('{"grpc"'):
                    doc = json.loads(line)
                    self.grpc, self.http = doc["grpc"], doc["http"]
                    return
            time.sleep(0.5)
        raise TimeoutError(f"the fleet did not start in {timeout}s")

    def start_router(self, name: str = "router", port: int | None = None, pdserve: str | None = None) -> dict:
        """Start the router (on ``port``: a restart keeps its address; ``pdserve``: the command of another
        checkout, for a baseline); seconds from its start until it is ready (/ready: a prefill routable) and
        until its index holds every stand-in's blocks."""
        port = port or free_port()
        self.router_url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        self.router = self.launcher.spawn(name, [*self._nice(), pdserve or self.launcher.pdserve, "router", "--port",
                                                 str(port),
                                                 "--model", "tiny", "--prefill", ",".join(self.grpc),
                                                 "--log-level", "WARNING"], cpus=self.router_cpus)
        self.launcher.wait_ready(self.router, self.router_url + "/ready", timeout=300)
        ready = time.monotonic() - t0
        self.wait_synced(timeout=600)
        synced = time.monotonic() - t0
        return {"ready_s": ready, "synced_s": synced, "router_cpu_s": cpu_seconds(self.router.popen.pid),
                "index_blocks": self.index_state()[1]}

    def _nice(self) -> list[str]:
        return ["nice", "-n", str(self.nice)] if self.nice else []

    def stop_router(self) -> None:
        if self.router is not None:
            self.launcher.stop(self.router)
            self.router = None

    def index_state(self) -> tuple[int, int]:
        """(prefills whose view is synced, blocks in the router's index) from its /health."""
        with urllib.request.urlopen(self.router_url + "/health", timeout=10) as r:
            prefills = json.loads(r.read())["prefills"]
        views = [p["index"] for p in prefills.values() if p["index"]]
        return sum(1 for v in views if v["synced"]), sum(v["blocks"] for v in views if v["synced"])

    def wait_synced(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.router is not None and self.router.popen.poll() is not None:
                raise RuntimeError(f"the router exited: {self.router.log.read_text()[-3000:]}")
            try:
                synced, _ = self.index_state()
                if synced == self.count:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the router's index did not sync {self.count} prefills in {timeout}s")

    def metrics(self) -> dict:
        samples = scrape(self.router_url + "/metrics")
        reasons = {}
        for (n, labels), v in samples.items():
            if n == "pdserve_router_index_resyncs_total":
                reason = dict(labels)["reason"]
                reasons[reason] = reasons.get(reason, 0) + v
        decisions = {}
        for (n, labels), v in samples.items():
            if n == "pdserve_router_decisions_total":
                reason = dict(labels)["reason"]
                decisions[reason] = decisions.get(reason, 0) + v
        return {"resyncs": reasons, "decisions": decisions,
                "overhead_s_sum": metric_sum(samples, "pdserve_router_overhead_seconds_sum"),
                "overhead_count": metric_sum(samples, "pdserve_router_overhead_seconds_count")}


def window(setup: Setup, via: str, bodies: list[bytes], arrivals: list[float]) -> dict:
    """One load through the router (``via="router"``) or straight to the stand-ins (``"direct"``)."""
    urls = [setup.router_url] if via == "router" else setup.http
    pid = setup.router.popen.pid if setup.router is not None else None
    before = setup.metrics() if via == "router" else None
    cpu0, t0 = (cpu_seconds(pid) if pid else 0.0), time.monotonic()
    load0 = os.getloadavg()[0]
    results = asyncio.run(send_all(urls, bodies, arrivals))
    wall = time.monotonic() - t0
    cpu = (cpu_seconds(pid) if pid else 0.0) - cpu0
    out = {"via": via, "offered_per_s": len(bodies) / arrivals[-1], "wall_s": wall,
           "router_cpu_s": cpu, "router_cpu_util": cpu / wall, "load_avg_1m": [load0, os.getloadavg()[0]],
           **summary(results, wall)}
    out["router_cpu_ms_per_request"] = cpu / max(1, out["ok"]) * 1e3
    if via == "router":
        after = setup.metrics()
        out["router_rss_bytes"] = rss_bytes(pid)
        out["resyncs_during"] = {k: v - before["resyncs"].get(k, 0) for k, v in after["resyncs"].items()
                                 if v - before["resyncs"].get(k, 0)}
        out["decisions_during"] = {k: v - before["decisions"].get(k, 0) for k, v in after["decisions"].items()
                                   if v - before["decisions"].get(k, 0)}
        n = after["overhead_count"] - before["overhead_count"]
        out["decide_ms_mean"] = (after["overhead_s_sum"] - before["overhead_s_sum"]) / n * 1e3 if n else None
    return out


def quiet(setup: Setup, seconds: float) -> float:
    """The router's CPU share while nothing is sent (load polls and event streams only)."""
    pid = setup.router.popen.pid
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - c0) / (time.monotonic() - t0)

