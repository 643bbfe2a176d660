"""``pdserve up --autoscale``: the planner over local processes.

Every ``--plan-interval`` seconds, one pass (``LocalAutoscaler.step``):

1. **observe** - scrape /metrics of every ready prefill and decode that is not draining (in
   parallel, short timeouts; one that does not answer is left out of this round) into a
   ``Snapshot``; the window runs from the snapshot ``--plan-window`` seconds old to this one
   (rates from its ends, gauges such as KV utilisation averaged over its snapshots).
2. **decide** - ``Planner.decide(window, replicas)``; replicas are the servers of each pool
   that are not draining.
3. **apply** - up: ``cluster.add_server(role)`` starts one more process; discovery lists it
   (decodes.txt / prefills.txt in the log folder) once it is ready. Down: the least loaded
   server of the pool (fewest requests in flight in the last scrape, then least KV in use,
   then the newest) is drained: SIGTERM, so it stops taking work (a decode's load report
   says draining and prefills stop picking it; a prefill tells the router it is not ready)
   and finishes what it has; it leaves discovery only when it has exited.
4. **record** - one JSON line per pool per decision in ``<log-dir>/autoscale.jsonl`` (time,
   current, desired, ready, signal, reason and the window's figures), and a line on the
   terminal for every change.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from pdserve.planner import POOLS, Decision, Planner, PlannerConfig, PoolLimits
from pdserve.planner.exposition import parse, total
from pdserve.planner.observe import KV_USED, RUNNING, WAITING, Snapshot, window_over


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("autoscaling (--autoscale: the planner starts and drains servers to meet the SLO)")
    g.add_argument("--autoscale", action="store_true",
                   help="run the planner: --prefill/--decode are the start counts, kept within the bounds below")
    g.add_argument("--min-prefill", type=int, default=1, help="fewest prefill processes")
    g.add_argument("--max-prefill", type=int, default=2,
                   help="most prefill processes (> 1: a router is the front door)")
    g.add_argument("--min-decode", type=int, default=1, help="fewest decode processes")
    g.add_argument("--max-decode", type=int, default=4, help="most decode processes")
    g.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="target time to first token, p90")
    g.add_argument("--slo-tbt-ms", type=float, default=100.0, help="target time between tokens, p90")
    g.add_argument("--plan-interval", type=float, default=2.0, help="seconds between decisions (each scrapes /metrics)")
    g.add_argument("--plan-window", type=float, default=6.0, help="seconds of metrics one decision looks at")
    g.add_argument("--scale-down-window", type=float, default=30.0,
                   help="scale down only to the highest need of this many seconds (stabilisation)")
    g.add_argument("--cooldown", type=float, default=15.0,
                   help="seconds after a scale-up, or a scale-down, before the next scale-down")


def planner_config(args: argparse.Namespace) -> PlannerConfig:
    """The planner's settings from the flags; SystemExit naming the flag when they do not fit."""
    for flag in ("plan_interval", "plan_window"):
        if not getattr(args, flag) > 0:
            raise SystemExit(f"pdserve up: --{flag.replace('_', '-')} must be > 0")
    if args.plan_window < args.plan_interval:
        raise SystemExit("pdserve up: --plan-window must be >= --plan-interval")
    try:
        limits = {pool: PoolLimits(getattr(args, f"min_{pool}"), getattr(args, f"max_{pool}")) for pool in POOLS}
        config = PlannerConfig(ttft_target_s=args.slo_ttft_ms / 1000, tbt_target_s=args.slo_tbt_ms / 1000,
                               down_stabilisation_s=args.scale_down_window, cooldown_s=args.cooldown, **limits)
    except ValueError as exc:
        raise SystemExit(f"pdserve up: autoscaling: {exc}") from None
    for pool in POOLS:
        start, lim = getattr(args, pool), config.limits(pool)
        if not lim.min_replicas <= start <= lim.max_replicas:
            raise SystemExit(f"pdserve up: --{pool} {start} is outside --min-{pool} {lim.min_replicas} .. "
                             f"--max-{pool} {lim.max_replicas}")
    if args.min_prefill < 1:
        raise SystemExit("pdserve up: --min-prefill must be >= 1 (the prefill is the front door)")
    return config


def fetch_metrics(url: str, timeout: float = 1.5) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read().decode()
    except (OSError, ValueError):
        return None


class LocalAutoscaler:
    """The loop of ``pdserve up --autoscale``; ``cluster`` offers ``servers(role)``,
    ``add_server(role, now)`` and ``drain_server(server)`` (see up.py's LocalCluster)."""

    def __init__(self, cluster, config: PlannerConfig, interval_s: float = 2.0, window_s: float = 6.0,
                 events: Path | None = None, say: Callable[[str], None] = print,
                 fetch: Callable[[str], str | None] = fetch_metrics, paused: Callable[[], bool] = lambda: False):
        self.cluster, self.planner, self.interval_s, self.window_s = cluster, Planner(config), interval_s, window_s
        self.events, self.say, self.fetch, self.paused = events, say, fetch, paused
        self.snapshots: deque[Snapshot] = deque()
        self.next_at = 0.0
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="scrape")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def active(self, role: str) -> list:
        return [s for s in self.cluster.servers(role) if s.state != "draining"]

    def observe(self, now: float) -> Snapshot:
        targets = {(role, s.name): s.metrics_url for role in POOLS for s in self.active(role) if s.state == "ready"}
        texts = dict(zip(targets, self._pool.map(self.fetch, targets.values())))
        parsed = {"prefill": {}, "decode": {}}
        for (role, name), text in texts.items():
            if text is not None:
                try:
                    parsed[role][name] = parse(text)
                except ValueError as exc:
                    self.say(f"[autoscale] {name}: unreadable /metrics ({exc})")
        return Snapshot(now, parsed["prefill"], parsed["decode"])

    def step(self, now: float) -> list[Decision]:
        """Observe, and decide when a whole window is in; returns the decisions that changed a pool.
        While ``paused()`` (a test's planner gate) it neither observes nor decides: its window starts after."""
        if now < self.next_at or self.paused():
            return []
        self.next_at = now + self.interval_s
        snap = self.observe(now)
        self.snapshots.append(snap)
        while len(self.snapshots) > 2 and self.snapshots[1].at <= now - self.window_s:
            self.snapshots.popleft()
        before = self.snapshots[0]
        if now - before.at < self.window_s * 0.9:  # not a whole window yet
            return []
        window = window_over(list(self.snapshots), self.planner.config.latency_quantile)
        plan = self.planner.decide(window, {role: len(self.active(role)) for role in POOLS}, now)
        for decision in plan.changes():
            self.say(f"[autoscale] {decision.describe()}")
            self.apply(decision, snap, now)
        self.record(plan, window)
        return plan.changes()

    def apply(self, decision: Decision, snap: Snapshot, now: float) -> None:
        role = decision.pool
        for _ in range(decision.desired - decision.current):
            server = self.cluster.add_server(role, now)
            self.say(f"[autoscale] starting {server.name}")
        for _ in range(decision.current - decision.desired):
            victim = self.least_loaded(role, getattr(snap, role))
            if victim is None:
                return
            self.say(f"[autoscale] draining {victim.name} (least loaded)")
            self.cluster.drain_server(victim)

    def least_loaded(self, role: str, samples: dict):
        def load(server) -> tuple:
            s = samples.get(server.name)
            if s is None or server.state != "ready":  # not serving yet: nothing to drain
                return (-1.0, -1.0, -_index(server.name))
            return (total(s, WAITING) + total(s, RUNNING), total(s, KV_USED), -_index(server.name))
        candidates = self.active(role)
        return min(candidates, key=load) if candidates else None

    def record(self, plan, window) -> None:
        if self.events is None:
            return
        figures = {"ttft_s": window.ttft_s, "tbt_s": window.tbt_s, "requests": window.requests,
                   "prefill_waiting": window.prefill.waiting,
                   "prefill_growth_per_s": round(window.prefill.waiting_growth_per_s, 3),
                   "prefill_busy": window.prefill.busy, "decode_kv": window.decode.kv_utilisation,
                   "decode_running": window.decode.running}
        with open(self.events, "a") as f:
            for d in plan:
                f.write(json.dumps({"time": time.time(), "pool": d.pool, "current": d.current,
                                    "desired": d.desired, "ready": d.ready, "signal": d.signal,
                                    "reason": d.reason, "window": figures}) + "\n")


def _index(name: str) -> int:
    tail = name.rpartition("-")[2]
    return int(tail) if tail.isdigit() else 0
