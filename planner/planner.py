"""Planner: one decision per pool per window, remembering enough of the past to stay steady.

``Planner(config).decide(window, replicas={"prefill": 2, "decode": 3})`` -> ``Plan`` (a
``Decision`` per pool: current, desired, the signal and a reason). ``replicas`` is what each
pool is set to now (the scale subresource's ``spec.replicas``, or the processes ``pdserve
up`` runs); ``window.<pool>.replicas`` is how many of them reported (ready).

On top of ``recommend`` (what this window alone calls for), per pool:

1. **Bounds**: desired stays within [min, max]; a pool outside them is brought inside first.
2. **Up is fast**: a recommendation above the current count is applied at once; only a
   latency breach with no utilisation or queue behind it waits for ``latency_confirm``
   windows in a row (one noisy percentile does not buy a replica). A scale-up already in
   progress (fewer ready than desired) is not repeated: recommendations count ready replicas.
3. **Down is slow** (the HPA's stabilisation): the pool shrinks to the *highest*
   recommendation of the last ``down_stabilisation_s`` seconds, by at most ``max_down_step``
   at a time, never while replicas are still starting, never within ``cooldown_s`` of a
   scale-up (a direction change) or of the previous scale-down, and not before the planner
   has watched a whole stabilisation window (a restarted planner starts cautious).

Time is whatever clock the windows use (``window.end``); tests drive it with synthetic series.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .config import POOLS, PlannerConfig
from .recommend import Recommendation, recommend
from .window import Window


@dataclass(frozen=True, slots=True)
class Decision:
    pool: str
    current: int
    desired: int
    ready: int
    signal: str
    reason: str
    at: float

    @property
    def direction(self) -> int:
        return (self.desired > self.current) - (self.desired < self.current)

    def describe(self) -> str:
        arrow = f"{self.current} -> {self.desired}" if self.direction else f"stays at {self.current}"
        return f"{self.pool} {arrow}: {self.reason}"


@dataclass(frozen=True, slots=True)
class Plan:
    prefill: Decision
    decode: Decision

    def __iter__(self):
        return iter((self.prefill, self.decode))

    def changes(self) -> list[Decision]:
        return [d for d in self if d.direction]


@dataclass(slots=True)
class _PoolMemory:
    history: deque = field(default_factory=deque)  # (time, recommended replicas)
    first_seen: float | None = None
    last_up: float = float("-inf")
    last_down: float = float("-inf")
    breach_streak: int = 0


class Planner:
    def __init__(self, config: PlannerConfig | None = None):
        self.config = config or PlannerConfig()
        self._memory = {pool: _PoolMemory() for pool in POOLS}

    def decide(self, window: Window, replicas: dict[str, int], now: float | None = None) -> Plan:
        now = window.end if now is None else now
        for pool in POOLS:
            if replicas.get(pool, -1) < 0:
                raise ValueError(f"replicas[{pool!r}] must be a count >= 0, got {replicas.get(pool)!r}")
        decisions = {pool: self._decide(pool, recommend(window, pool, self.config), replicas[pool],
                                        window.pool(pool).replicas, now, window.notes) for pool in POOLS}
        return Plan(**decisions)

    def _decide(self, pool: str, rec: Recommendation, current: int, ready: int, now: float,
                notes: tuple[str, ...]) -> Decision:
        cfg, mem = self.config, self._memory[pool]
        limits = cfg.limits(pool)
        if mem.first_seen is None:
            mem.first_seen = now
        mem.breach_streak = mem.breach_streak + 1 if rec.latency_breach else 0
        starting = ready < current
        # what this window lets the pool shrink to; a held or mid-scale-up window counts as "no fewer"
        floor = max(rec.replicas, current) if rec.hold or starting else rec.replicas
        mem.history.append((now, floor))
        while mem.history and mem.history[0][0] < now - cfg.down_stabilisation_s:
            mem.history.popleft()
        suffix = f" [{'; '.join(notes)}]" if notes else ""

        def decision(desired: int, signal: str, reason: str) -> Decision:
            if desired > current:
                mem.last_up = now
            elif desired < current:
                mem.last_down = now
            return Decision(pool, current, desired, ready, signal, reason + suffix, now)

        if not limits.min_replicas <= current <= limits.max_replicas:
            return decision(limits.clamp(current), "bounds",
                            f"{current} is outside min {limits.min_replicas} .. max {limits.max_replicas}")
        target = limits.clamp(rec.replicas)
        capped = f" (capped at max {limits.max_replicas})" if rec.replicas > limits.max_replicas else ""
        if target > current:
            if rec.latency_only and mem.breach_streak < cfg.latency_confirm:
                return decision(current, "hold", f"{rec.reason}: window {mem.breach_streak} of {cfg.latency_confirm} "
                                                 f"before scaling up on latency alone")
            return decision(target, rec.signal, rec.reason + capped)
        if target == current or rec.replicas >= current:
            if rec.replicas > current:  # already at max
                return decision(current, rec.signal, rec.reason + capped)
            if starting and rec.replicas > ready:
                return decision(current, "starting", f"scale-up to {current} in progress ({ready} ready): {rec.reason}")
            at_min = f" (held at min {limits.min_replicas})" if rec.replicas < current else ""
            return decision(current, rec.signal, rec.reason + at_min)
        # the window alone would shrink the pool: is it safe and lasting?
        hold = None
        if starting:
            hold = f"{current - ready} of {current} replica(s) still starting"
        elif now - mem.last_up < cfg.cooldown_s:
            hold = f"scaled up {now - mem.last_up:.0f}s ago (cooldown {cfg.cooldown_s:g}s)"
        elif now - mem.last_down < cfg.cooldown_s:
            hold = f"scaled down {now - mem.last_down:.0f}s ago (cooldown {cfg.cooldown_s:g}s)"
        elif now - mem.first_seen < cfg.down_stabilisation_s:
            hold = f"watching {now - mem.first_seen:.0f}s of {cfg.down_stabilisation_s:g}s before any scale-down"
        stabilised = limits.clamp(max(r for _, r in mem.history))
        if hold is None and stabilised >= current:
            hold = f"the last {cfg.down_stabilisation_s:g}s asked for {stabilised}"
        if hold is not None:
            return decision(current, "hold", f"{rec.reason}; holding: {hold}")
        desired = max(stabilised, current - cfg.max_down_step)
        return decision(desired, rec.signal,
                        f"{rec.reason}; lowest need over {cfg.down_stabilisation_s:g}s: {stabilised}")
