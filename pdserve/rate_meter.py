"""Meters of what the cost model of disaggregation is fed (prefill_server/cost_model.py), over
the last few samples. Pure, no I/O; not thread-safe (one event loop owns each).

- ``RateMeter``: ``add(amount, seconds)`` records one sample (ignored when either is not
  positive); ``rate()`` is the median of amount / seconds over the last ``window`` samples,
  or None before any. A decode's tokens per second of the prompts it computed itself.
- ``CostMeter``: the same samples fitted as ``seconds = fixed + amount * per_unit``
  (``LinearCost``): a prefill's forward passes (tokens) and its KV transfers (bytes over
  link-busy time), where a per-operation overhead is not a throughput.

Both are medians, not means: one outlier (the first forward pass of a process warms its
kernels up and took a second here; a shared machine stalls) must not set the estimate.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass


class RateMeter:
    def __init__(self, window: int = 32):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)

    def add(self, amount: float, seconds: float) -> None:
        if amount > 0 and seconds > 0:
            self._samples.append((float(amount), float(seconds)))

    def rate(self) -> float | None:
        if not self._samples:
            return None
        return statistics.median(a / s for a, s in self._samples)

    def samples(self) -> list[tuple[float, float]]:
        """The (amount, seconds) samples in the window, oldest first."""
        return list(self._samples)

    def __len__(self) -> int:
        return len(self._samples)


@dataclass(frozen=True, slots=True)
class LinearCost:
    """seconds = fixed_s + amount * per_unit_s (a per-operation overhead plus a throughput)."""

    fixed_s: float
    per_unit_s: float

    def seconds(self, amount: float) -> float:
        return self.fixed_s + amount * self.per_unit_s

    @property
    def rate(self) -> float:
        """Amount per second once the fixed part is paid (the marginal throughput)."""
        return 1.0 / self.per_unit_s


class CostMeter:
    """Fits ``seconds = fixed + amount * per_unit`` to the last ``window`` samples (Theil-Sen:
    the median of the pairwise slopes, then the median intercept).

    A throughput alone (``RateMeter``) mistakes a per-operation overhead for slowness: on a link
    where every transfer pays ~1 ms of latency, small transfers look slow and large ones are
    over-estimated from them. ``fit()`` is None before any sample; it falls back to the median
    ratio (``fixed = 0``) while the samples' amounts are too alike to separate the two (the
    largest < 1.5x the smallest, or fewer than 3) or the fit is not physical (a negative part).
    """

    def __init__(self, window: int = 32):
        self._meter = RateMeter(window)

    def add(self, amount: float, seconds: float) -> None:
        self._meter.add(amount, seconds)

    def __len__(self) -> int:
        return len(self._meter)

    def fit(self) -> LinearCost | None:
        samples = self._meter.samples()
        if not samples:
            return None
        if len(samples) >= 3 and max(a for a, _ in samples) >= 1.5 * min(a for a, _ in samples):
            slopes = [(sj - si) / (aj - ai) for i, (ai, si) in enumerate(samples) for aj, sj in samples[i + 1:]
                      if aj != ai]
            slope = statistics.median(slopes)
            fixed = statistics.median(s - slope * a for a, s in samples)
            if slope > 0 and fixed >= 0:
                return LinearCost(fixed, slope)
        return LinearCost(0.0, statistics.median(s / a for a, s in samples))
