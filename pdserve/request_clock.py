"""RequestClock: one request's latencies as its client sees them (TTFT, time between tokens, end
to end), recorded into a ServerMetrics (``pdserve/metrics.py``, whose ``request_clock()`` makes one)."""

from __future__ import annotations

import time

OUTCOMES = ("ok", "error", "cancelled")


class RequestClock:
    """Times one request as its client sees it: TTFT, time between tokens, end to end.

    Created by ``ServerMetrics.request_clock()`` at arrival. Call ``token(n)`` when n tokens
    are sent to the client (n > 1 spreads the gap evenly), ``finish(outcome, reason)`` once at
    the end; it records e2e latency and the requests counter. Not thread-safe: one request
    is handled by one task.
    """

    __slots__ = ("_m", "start", "_last", "tokens", "done")

    def __init__(self, metrics):  # a ServerMetrics (not imported: metrics.py imports this module)
        self._m = metrics
        self.start = time.perf_counter()
        self._last: float | None = None
        self.tokens = 0
        self.done = False

    def token(self, n: int = 1) -> None:
        if n < 1:
            raise ValueError(f"token count must be >= 1, got {n}")
        now = time.perf_counter()
        if self._last is None:
            self._m.ttft.observe(now - self.start)
            n_gaps = n - 1
            gap = 0.0
        else:
            n_gaps = n
            gap = (now - self._last) / n
        for _ in range(n_gaps):
            self._m.tbt.observe(gap)
        self._last = now
        self.tokens += n
        self._m.generation_tokens.inc(n)

    def finish(self, outcome: str = "ok", reason: str = "stop") -> None:
        if self.done:
            return
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        self.done = True
        self._m.e2e_latency.observe(time.perf_counter() - self.start)
        self._m.requests.labels(outcome=outcome, reason=reason).inc()
