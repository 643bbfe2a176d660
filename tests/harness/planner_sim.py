"""A toy closed loop for the planner's unit tests: pools whose load follows the replicas.

Demand is given in replica-equivalents: ``kv`` (decode KV the traffic holds, in whole decode
pools' worth) and ``busy`` (prefill compute, in whole prefills' worth). Each window the sim
spreads demand over the *ready* replicas, grows a queue at prefill where demand exceeds
capacity (drains it otherwise), derives TTFT/TBT from that, asks the planner, and applies
its plan: new replicas become ready ``start_s`` later; removed ones go at once (drained).
"""

from __future__ import annotations

import random

from pdserve.planner import Planner, PlannerConfig, PoolLoad, Window


class Sim:
    def __init__(self, config: PlannerConfig | None = None, prefill: int = 1, decode: int = 1, dt: float = 5.0,
                 start_s: float = 10.0, seed: int = 0):
        self.planner = Planner(config or PlannerConfig())
        self.cfg = self.planner.config
        self.replicas = {"prefill": prefill, "decode": decode}
        self.ready = dict(self.replicas)
        self.pending: list[tuple[float, str]] = []  # (ready at, pool)
        self.t, self.dt, self.start_s = 0.0, dt, start_s
        self.queue = {"prefill": 0.0, "decode": 0.0}  # requests waiting at prefill, by whose capacity is short
        self.rng = random.Random(seed)
        self.log: list = []  # plans

    def window(self, kv: float, busy: float, noise: float = 0.0, ttft: float | None = None,
               tbt: float | None = None) -> Window:
        jitter = (lambda: 1 + self.rng.uniform(-noise, noise)) if noise else (lambda: 1.0)
        n_p, n_d = self.ready["prefill"], self.ready["decode"]
        before = sum(self.queue.values())
        for pool, demand, n in (("prefill", busy, n_p), ("decode", kv, n_d)):
            rate = (demand - n) * 4  # requests/s piling up (or draining) at prefill
            self.queue[pool] = max(0.0, self.queue[pool] + rate * self.dt)
        waiting = sum(self.queue.values())
        kv_util = min(1.0, kv * jitter() / n_d)
        busy_per = busy * jitter() / n_p
        if ttft is None:
            ttft = 0.3 * max(1.0, busy_per / 0.7) + 0.05 * waiting
        if tbt is None:
            tbt = 0.03 + 0.3 * max(0.0, kv_util - 0.8)
        return Window(end=self.t, duration_s=self.dt, ttft_s=ttft * jitter(), tbt_s=tbt * jitter(), requests=100,
                      prefill=PoolLoad(n_p, waiting=waiting, running=20 * kv,
                                       waiting_growth_per_s=(waiting - before) / self.dt,
                                       busy=busy_per, tokens_per_s=1000 * busy),
                      decode=PoolLoad(n_d, waiting=0, running=20 * kv, kv_utilisation=kv_util, tokens_per_s=500 * kv))

    def step(self, kv: float, busy: float = 0.3, **kw):
        self.t += self.dt
        for at, pool in [p for p in self.pending if p[0] <= self.t]:
            self.pending.remove((at, pool))
            self.ready[pool] += 1
        plan = self.planner.decide(self.window(kv, busy, **kw), dict(self.replicas))
        for d in plan:
            assert d.reason, d
            if d.direction > 0:
                self.pending += [(self.t + self.start_s, d.pool)] * (d.desired - d.current)
            elif d.direction < 0:
                self.ready[d.pool] -= d.current - d.desired
            self.replicas[d.pool] = d.desired
        self.log.append(plan)
        return plan

    def run(self, series, **kw):
        """series: iterable of (kv, busy) per window."""
        return [self.step(kv, busy, **kw) for kv, busy in series]

    def counts(self, pool: str) -> list[int]:
        return [getattr(p, pool).desired for p in self.log]

    def direction_changes(self, pool: str) -> int:
        dirs = [getattr(p, pool).direction for p in self.log if getattr(p, pool).direction]
        return sum(1 for a, b in zip(dirs, dirs[1:]) if a != b)

    def changes(self, pool: str) -> int:
        return sum(1 for p in self.log if getattr(p, pool).direction)
