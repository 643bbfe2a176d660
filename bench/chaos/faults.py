"""The chaos loop: at random intervals, SIGKILL or pause (SIGSTOP ... SIGCONT) a server, or
(with --netem) shape the network between prefill and decode for a few seconds.

Lifecycle of one fault (``Fault``):

1. **pick**: every ``interval`` seconds on average (uniform in [0.5, 1.5] x interval) a
   kind is drawn from ``kinds`` (kill-decode, stop-decode, kill-prefill, stop-prefill,
   netem) and a target among the servers of that role that are ready and not already faulted;
   a fault is skipped when it would leave no decode serving, or no prefill serving where there
   are two or more (issue 32's premise: one replica of each role always up; the router resumes
   the streams of the one that dies). A single prefill, the front door itself, may be hit.
2. **inject**: ``kill`` sends SIGKILL to the server's pid (from ``<up log-dir>/servers.json``,
   which ``pdserve up`` rewrites on every start); ``stop`` sends SIGSTOP; ``netem`` has the
   ``Shaper`` (netem.py) shape the decodes' gRPC and KV ports (target ``prefill<->decode``,
   pid 0, ``netem`` = what was applied); at most one netem fault at a time.
3. **recover**: a paused server gets SIGCONT after ``pause_s`` (drawn from ``pause``); a
   netem fault is cleared (lo back to a clean qdisc) after ``pause_s`` (drawn from ``netem_s``); a
   killed one is recovered when the supervisor of ``pdserve up`` has started a new pid for
   it and that pid is ready. ``recovered_at`` records when.

``restore()`` sends SIGCONT to anything still paused (the bench calls it in ``finally``),
and clears the shaping, so a run that fails never leaves a stopped process or a shaped link behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

KINDS = ("kill-decode", "stop-decode", "kill-prefill", "stop-prefill", "netem")
NETEM_TARGET = "prefill<->decode"


@dataclass(slots=True)
class Fault:
    time: float                 # seconds since the run start
    kind: str
    target: str                 # server name as pdserve up calls it (decode-1, prefill-0)
    pid: int
    pause_s: float | None = None       # how long a pause or a netem fault lasts
    recovered_at: float | None = None
    netem: str | None = None           # netem faults: the shaping applied (Shaper.describe())
    netem_stats: dict | None = None    # and what its qdiscs passed and dropped ({handle: {sent_pkts, dropped}})

    def to_json(self) -> dict:
        return asdict(self)

    def outage(self, horizon: float) -> tuple[float, float]:
        """(begin, end) of the time the target did not serve (end = horizon if it never came back)."""
        return self.time, self.recovered_at if self.recovered_at is not None else horizon


def read_servers(state_file: Path) -> dict:
    try:
        return json.loads(Path(state_file).read_text())
    except (OSError, ValueError):
        return {}  # being rewritten: the next tick reads it again


class FaultLoop:
    def __init__(self, state_file: Path, rng: random.Random, interval: float, pause: tuple[float, float],
                 kinds: tuple[str, ...], t0: float, say=print, shaper=None,
                 netem_s: tuple[float, float] = (3.0, 6.0)):
        unknown = set(kinds) - set(KINDS)
        if unknown or not kinds:
            raise ValueError(f"fault kinds must be among {KINDS}, got {kinds}")
        if "netem" in kinds and shaper is None:
            raise ValueError("the netem fault needs a Shaper (pdserve bench chaos --netem)")
        if interval <= 0 or not 0 < pause[0] <= pause[1]:
            raise ValueError("need interval > 0 and 0 < pause min <= pause max")
        self.state_file, self.rng, self.interval, self.pause, self.kinds = state_file, rng, interval, pause, kinds
        self.t0, self.say, self.shaper, self.netem_s = t0, say, shaper, netem_s
        self.faults: list[Fault] = []
        self._open: list[Fault] = []   # not recovered yet

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def run(self, until: float) -> None:
        """Inject faults until `until` (seconds since t0), then wait for every target to recover."""
        next_at = self.now() + self.rng.uniform(0.5, 1.5) * self.interval
        while self.now() < until or self._open:
            self._recover()
            if self.now() >= next_at and self.now() < until:
                self._inject()
                next_at = self.now() + self.rng.uniform(0.5, 1.5) * self.interval
            if self.now() > until + 180:
                self.say(f"chaos: {[f.target for f in self._open]} did not recover within 180 s of the end")
                break
            await asyncio.sleep(0.25)

    def _busy(self) -> set[str]:
        return {f.target for f in self._open}

    def _inject(self) -> None:
        servers = read_servers(self.state_file)
        for kind in self.rng.sample(self.kinds, len(self.kinds)):
            if kind == "netem":
                if NETEM_TARGET in self._busy():
                    continue
                fault = Fault(self.now(), kind, NETEM_TARGET, 0, pause_s=round(self.rng.uniform(*self.netem_s), 2),
                              netem=self.shaper.describe())
                self.shaper.apply()
                self.faults.append(fault)
                self._open.append(fault)
                self.say(f"chaos t={fault.time:6.1f}s netem for {fault.pause_s}s: {fault.netem}")
                return
            action, role = kind.split("-")
            ready = [n for n, s in servers.items() if n.startswith(role) and s["state"] == "ready"
                     and n not in self._busy()]
            replicas = sum(n.startswith(role) for n in servers)
            if (role == "decode" or replicas >= 2) and len(ready) < 2:
                continue  # keep one replica of the role serving (a single prefill may still be hit)
            if not ready:
                continue
            target = self.rng.choice(sorted(ready))
            pid = servers[target]["pid"]
            fault = Fault(self.now(), kind, target, pid)
            try:
                if action == "kill":
                    os.kill(pid, signal.SIGKILL)
                else:
                    fault.pause_s = round(self.rng.uniform(*self.pause), 2)
                    os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                continue
            self.faults.append(fault)
            self._open.append(fault)
            self.say(f"chaos t={fault.time:6.1f}s {kind} {target} (pid {pid})"
                     + (f" for {fault.pause_s}s" if fault.pause_s else ""))
            return

    def _recover(self) -> None:
        if not self._open:
            return
        servers, now = read_servers(self.state_file), self.now()
        for fault in list(self._open):
            if fault.kind == "netem":
                if now >= fault.time + fault.pause_s:
                    fault.netem_stats = self.shaper.clear()
                    fault.recovered_at = now
            elif fault.pause_s is not None:
                if now >= fault.time + fault.pause_s:
                    self._cont(fault.pid)
                    fault.recovered_at = now
            else:
                s = servers.get(fault.target, {})
                if s.get("pid") not in (None, fault.pid) and s.get("state") == "ready":
                    fault.recovered_at = now
            if fault.recovered_at is not None:
                self._open.remove(fault)

    @staticmethod
    def _cont(pid: int) -> None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def restore(self) -> None:
        for fault in self._open:
            if fault.kind != "netem" and fault.pause_s is not None:
                self._cont(fault.pid)
        if self.shaper is not None:
            stats = self.shaper.clear()
            for fault in self._open:
                if fault.kind == "netem" and fault.netem_stats is None:
                    fault.netem_stats = stats
