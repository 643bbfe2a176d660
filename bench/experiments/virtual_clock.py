"""The virtual clock of ``pdserve bench experiment scale --clock virtual``: events in time order, one process.

``Clock.at(t, fn, *args)`` schedules ``fn(*args)`` at simulated second ``t``; ``run()`` pops events in time order
(ties in the order they were scheduled) and sets ``now`` to each one's time before calling it, so time advances by
events, never by sleeping. ``next_time()`` is the earliest pending event's time (a decode that knows nothing can
happen before it advances its own steps without the heap: ``virtual_decode.py``). Scheduling in the past is an
error (the simulation would run backwards).

``VRequest`` is one request's state and timestamps as the simulated cluster serves it; ``result()`` is the
client's view of it (``loadgen_report.RequestResult``: TTFT and end-to-end from its arrival, one gap: its mean
time between tokens, which is what the SLO reads).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from pdserve.bench.loadgen_report import RequestResult


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = 0
        self.events = 0  # events run so far (a counter)

    def at(self, t: float, fn: Callable[..., Any], *args) -> None:
        if t < self.now - 1e-12:
            raise ValueError(f"event at {t} s scheduled in the past (now {self.now} s)")
        heapq.heappush(self._heap, (max(t, self.now), self._seq, fn, args))
        self._seq += 1

    def next_time(self) -> float:
        return self._heap[0][0] if self._heap else math.inf

    def run(self, until: float = math.inf) -> None:
        """Every event up to ``until`` (simulated seconds), in time order."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            self.events += 1
            fn(*args)


@dataclass(eq=False, slots=True)
class VRequest:
    index: int
    arrival: float
    prompt: Any  # a sequence of token ids (scale_workload.BlockPrompt): made into a list when a part reads it
    n_prompt: int
    n_out: int
    prefill: str = ""
    decode: str = ""
    ids: list[int] | None = None  # the prompt as a list while a prefill or decode holds it
    prefill_cached: int = 0  # prompt tokens the prefill's prefix cache held (the engine's own count)
    decode_cached_blocks: int = 0  # leading prompt blocks the decode held (they do not move)
    decode_table: list[int] = field(default_factory=list)
    allocated_at: float | None = None  # when a decode reserved its blocks (the Session's Allocation)
    kv_at: float = 0.0  # when the last of its KV reached the decode (the modelled link)
    computed_at: float = 0.0  # when the prefill's engine computed its last prompt token
    first_at: float | None = None  # first token at the client
    finish_at: float | None = None
    error: str = ""

    def result(self) -> RequestResult:
        r = RequestResult(self.index, self.n_prompt, self.n_out, sent_at=self.arrival)
        if self.first_at is None or self.finish_at is None:
            r.error = self.error or "not finished"
            return r
        r.ok, r.ttft, r.e2e = True, self.first_at - self.arrival, self.finish_at - self.arrival
        r.usage_prompt_tokens, r.usage_completion_tokens, r.chunks = self.n_prompt, self.n_out, self.n_out
        if self.n_out >= 2:
            r.gaps = [(self.finish_at - self.first_at) / (self.n_out - 1)]
        return r
