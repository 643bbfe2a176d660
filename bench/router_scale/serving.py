"""One router process, pinned to one CPU, in front of a fleet of stand-in prefills (``fleet.py``).

``Setup`` starts the fleet (one process, ``fleet_cpus``) and ``pdserve router`` (``router_cpus``,
``--prefill`` every stand-in's gRPC address), waits until the router's index holds every stand-in's
blocks (its /health), and can restart the router (``restart_router``); ``profile``: the router runs under
the standard library's cProfile, its statistics written when it stops. ``window`` sends one load
(``client.send_all``, from this process: pin it with ``os.sched_setaffinity``) through the router, straight
to the stand-ins, or both interleaved (the added latency: one load, the same moments), and reads the
router's CPU seconds (``/proc/PID/stat``) over it and its own time per request (``residence.py``). ``rt``:
the fleet and the router run under SCHED_FIFO (``chrt -f``) at that priority, ahead of the shared box's other
work (the kernel still leaves 5% of each core to the rest: ``sched_rt_runtime_us``).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.experiments.launcher import Launcher, Proc, metric_sum, scrape
from pdserve.net import free_port

from . import residence
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
    rt: int = 0  # > 0: the fleet and the router run SCHED_FIFO at this priority instead (chrt -f)
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

    def start_router(self, name: str = "router", port: int | None = None, pdserve: str | None = None,
                     profile: Path | None = None, extra: list[str] | None = None) -> dict:
        """Start the router (on ``port``: a restart keeps its address; ``pdserve``: the command of another
        checkout, for a baseline; ``profile``: under cProfile, its statistics to that file when it stops;
        ``extra``: more arguments);
        seconds from its start until it is ready (/ready: a prefill routable) and until its index holds every
        stand-in's blocks."""
        import sys

        port = port or free_port()
        self.router_url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        command = [pdserve or self.launcher.pdserve]
        if profile is not None:
            command = [sys.executable, "-m", "cProfile", "-o", str(profile), "-m", "pdserve"]
        self.router = self.launcher.spawn(name, [*self._nice(), *command, "router", "--port", str(port),
                                                 "--model", "tiny", "--prefill", ",".join(self.grpc),
                                                 "--log-level", "WARNING", *(extra or [])], cpus=self.router_cpus)
        self.launcher.wait_ready(self.router, self.router_url + "/ready", timeout=300)
        ready = time.monotonic() - t0
        self.wait_synced(timeout=600)
        synced = time.monotonic() - t0
        return {"ready_s": ready, "synced_s": synced, "router_cpu_s": cpu_seconds(self.router.popen.pid),
                "index_blocks": self.index_state()[1]}

    def _nice(self) -> list[str]:
        if self.rt:
            return ["chrt", "-f", str(self.rt)]
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

    def views(self) -> dict[str, dict | None]:
        """The router's index entry of each stand-in (gRPC address -> epoch, seq, synced, blocks; None: none)."""
        with urllib.request.urlopen(self.router_url + "/health", timeout=10) as r:
            prefills = json.loads(r.read())["prefills"]
        return {a: (prefills.get(a) or {}).get("index") for a in self.grpc}

    def fleet_states(self) -> dict[str, dict]:
        """Each stand-in's own epoch, last seq and blocks (its GET /state), by gRPC address."""
        out = {}
        for grpc_address, url in zip(self.grpc, self.http):
            with urllib.request.urlopen(url + "/state", timeout=10) as r:
                out[grpc_address] = json.loads(r.read())
        return out

    def index_agreement(self, timeout: float = 30.0) -> dict:
        """Once the load is over: whether the router's index says of every stand-in what it holds (same epoch,
        last seq and blocks: no event lost), waiting up to ``timeout`` for the last events to arrive."""
        t0 = time.monotonic()
        while True:
            truth, views = self.fleet_states(), self.views()
            wrong = sorted(a for a, t in truth.items() if not agrees(views.get(a), t))
            if not wrong or time.monotonic() - t0 > timeout:
                break
            time.sleep(0.2)
        return {"prefills": len(truth), "agree": len(truth) - len(wrong), "wrong": wrong[:8],
                "after_s": time.monotonic() - t0, "blocks": sum(t["blocks"] for t in truth.values()),
                "index_blocks": sum((v or {}).get("blocks", 0) for v in views.values())}

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


def agrees(view: dict | None, truth: dict) -> bool:
    """A router's index entry of a prefill says what the prefill holds: synced, same epoch, seq and blocks."""
    return (view is not None and view["synced"] and view["epoch"] == truth["epoch"] and view["seq"] == truth["seq"]
            and view["blocks"] == truth["blocks"])


VIAS = ("router", "direct", "both")


def urls_of(via: str, router_url: str, direct: list[str]) -> list[str]:
    """The URLs ``client.send_all`` takes in turn: the router, the stand-ins, or (``both``) the router for
    every even request and the stand-ins in turn for the odd ones (``sides`` splits the results back)."""
    if via not in VIAS:
        raise ValueError(f"via must be one of {VIAS}, got {via!r}")
    if via == "router":
        return [router_url]
    if via == "direct":
        return list(direct)
    return [u for d in direct for u in (router_url, d)]


def sides(results: list, via: str) -> tuple[list, list]:
    """(the requests that went through the router, those sent straight to a stand-in) of one window."""
    if via == "both":
        return results[0::2], results[1::2]
    return (results, []) if via == "router" else ([], results)


def window(setup: Setup, via: str, bodies: list[bytes], arrivals: list[float]) -> dict:
    """One load through the router (``via="router"``), straight to the stand-ins (``"direct"``), or both
    interleaved (``"both"``: the router's side and the direct side share the load and its moments; the
    figures of the router's side are the window's, the direct side's are under ``direct``)."""
    urls = urls_of(via, setup.router_url, setup.http)
    pid = setup.router.popen.pid if setup.router is not None else None
    before = setup.metrics() if via != "direct" else None
    own0 = residence.count(setup.router_url) if via != "direct" else None  # None: no such route (older router)
    cpu0, t0 = (cpu_seconds(pid) if pid else 0.0), time.monotonic()
    load0 = os.getloadavg()[0]
    results = asyncio.run(send_all(urls, bodies, arrivals))
    wall = time.monotonic() - t0
    cpu = (cpu_seconds(pid) if pid else 0.0) - cpu0
    routed, direct = sides(results, via)
    out = {"via": via, "offered_per_s": len(bodies) / arrivals[-1], "wall_s": wall,
           "router_cpu_s": cpu, "router_cpu_util": cpu / wall, "load_avg_1m": [load0, os.getloadavg()[0]],
           **summary(routed if via != "direct" else direct, wall)}
    if via == "both":
        out["direct"] = summary(direct, wall)
    out["router_cpu_ms_per_request"] = cpu / max(1, out["ok"]) * 1e3
    if via != "direct":
        after = setup.metrics()
        out["router_rss_bytes"] = rss_bytes(pid)
        out["resyncs_during"] = {k: v - before["resyncs"].get(k, 0) for k, v in after["resyncs"].items()
                                 if v - before["resyncs"].get(k, 0)}
        out["decisions_during"] = {k: v - before["decisions"].get(k, 0) for k, v in after["decisions"].items()
                                   if v - before["decisions"].get(k, 0)}
        n = after["overhead_count"] - before["overhead_count"]
        out["decide_ms_mean"] = (after["overhead_s_sum"] - before["overhead_s_sum"]) / n * 1e3 if n else None
    if own0 is not None:  # the router's own time per request (router/residence.py)
        routed_ids = list(range(0, len(results), 2 if via == "both" else 1))
        rows = residence.rows(setup.router_url, own0) or []
        out["residence"] = residence.summarize(rows, results, routed_ids)
        out["residence_rows"] = rows  # each request's parts (seconds), with its index in the window
    return out


def core_capacity(cpu_s: float, wall_s: float, quiet_util: float, requests: int) -> dict:
    """What one core carries, from a window's router CPU: the CPU a request adds (the window's less the
    router's idle share, ``quiet_util``, over its wall time) and the core left after the idle work.
    ``naive``: the window's CPU over its requests (the idle work amortized at that window's rate)."""
    marginal = (cpu_s - quiet_util * wall_s) / max(1, requests)
    out = {"marginal_ms_per_request": marginal * 1e3, "naive_per_s": requests / cpu_s if cpu_s > 0 else None,
           "per_s": (1.0 - quiet_util) / marginal if marginal > 0 else None}
    return out


def quiet(setup: Setup, seconds: float) -> float:
    """The router's CPU share while nothing is sent (load polls and event streams only)."""
    pid = setup.router.popen.pid
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - c0) / (time.monotonic() - t0)

