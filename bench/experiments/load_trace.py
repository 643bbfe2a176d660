"""The load trace of experiment 6 (autoscale): quiet, a burst, a plateau, a ramp down, quiet.

``LoadTrace`` is a piecewise rate in requests/s: ``quiet_s`` at ``rate``, then at once
``burst`` x ``rate`` for ``plateau_s``, then a linear ramp back to ``rate`` over ``ramp_s``, then
``tail_s`` at ``rate``. ``arrivals(seed)`` draws Poisson arrivals from it (thinning), the same
for every arm of the experiment.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoadTrace:
    rate: float = 0.5
    burst: float = 4.0
    quiet_s: float = 20.0
    plateau_s: float = 40.0
    ramp_s: float = 20.0
    tail_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if self.burst < 1:
            raise ValueError(f"burst must be >= 1, got {self.burst}")
        for name in ("quiet_s", "plateau_s", "ramp_s", "tail_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def burst_at(self) -> float:
        return self.quiet_s

    @property
    def ramp_at(self) -> float:
        return self.quiet_s + self.plateau_s

    @property
    def quiet_again_at(self) -> float:
        return self.ramp_at + self.ramp_s

    @property
    def duration_s(self) -> float:
        return self.quiet_again_at + self.tail_s

    def rate_at(self, t: float) -> float:
        if t < self.burst_at or t >= self.quiet_again_at:
            return self.rate if 0 <= t < self.duration_s else 0.0
        if t < self.ramp_at:
            return self.rate * self.burst
        done = (t - self.ramp_at) / self.ramp_s
        return self.rate * (self.burst - (self.burst - 1) * done)

    def phases(self) -> list[tuple[str, float, float]]:
        return [("quiet", 0.0, self.burst_at), ("burst + plateau", self.burst_at, self.ramp_at),
                ("ramp down", self.ramp_at, self.quiet_again_at), ("quiet", self.quiet_again_at, self.duration_s)]

    def arrivals(self, seed: int = 0) -> list[float]:
        """Poisson arrival times (s) with rate ``rate_at(t)`` (Lewis-Shedler thinning)."""
        rng, peak = random.Random(seed), self.rate * self.burst
        out, t = [], 0.0
        while True:
            t += rng.expovariate(peak)
            if t >= self.duration_s:
                return out
            if rng.random() * peak <= self.rate_at(t):
                out.append(t)
