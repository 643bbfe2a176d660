"""BusyClock: the seconds an engine spent running steps, a monotonic counter readable from any thread.

One engine thread runs one step at a time, so its steps never overlap: the counter is the engine
core's own busy time, and its growth over a window divided by the window is the engine's utilisation
(at most 1). Requests' own intervals (allocation to first token, say) are not: several requests share
every step of a batch, and their sum counts each step once per request in it.

The engine thread brackets every step with ``begin()`` and ``end()``; ``seconds()`` (any thread) is the
finished steps' total plus the step in progress up to now, so a reader between two long steps sees the
time as it passes, never a jump when the step ends, and a later read is never smaller than an earlier one.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class BusyClock:
    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._lock = threading.Lock()
        self._total = 0.0
        self._since: float | None = None  # the step in progress began then (None: no step)

    def begin(self) -> None:
        """On the engine thread: a step starts (a second ``begin`` before ``end`` keeps the first)."""
        with self._lock:
            if self._since is None:
                self._since = self._clock()

    def end(self) -> float:
        """On the engine thread: the step is over; its seconds (0.0 if none had begun)."""
        with self._lock:
            if self._since is None:
                return 0.0
            seconds = max(0.0, self._clock() - self._since)
            self._total += seconds
            self._since = None
            return seconds

    def seconds(self) -> float:
        """Seconds spent in steps since start, the one in progress up to now (any thread)."""
        with self._lock:
            running = max(0.0, self._clock() - self._since) if self._since is not None else 0.0
            return self._total + running
