"""RateMeter: a rate (amount per second) measured over the last few samples. Pure, no I/O.

Used for what the cost model of disaggregation is fed (prefill_server/cost_model.py): a
prefill's prompt tokens per second of its own forward passes, the KV bytes per second of its
recent transfers, a decode's tokens per second of the prompts it computed itself.

Contract: ``add(amount, seconds)`` records one sample (ignored when either is not positive);
``rate()`` is sum(amount) / sum(seconds) over the last ``window`` samples (large samples
weigh more than small ones, as they should for a throughput), or None before any sample.
Not thread-safe: one event loop owns it.
"""

from __future__ import annotations

from collections import deque


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
        return sum(a for a, _ in self._samples) / sum(s for _, s in self._samples)

    def __len__(self) -> int:
        return len(self._samples)
