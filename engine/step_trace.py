"""StepTrace: what happened in and just before each engine step, for finding where slow steps come from.

A debug recorder (``EngineConfig.step_trace``: how many steps it keeps, 0 = off; the decode's
``--step-trace FILE`` turns it on and writes the records there at stop). The engine thread
(``async_engine.py``) calls ``calls_done`` after the queued calls it ran between two steps and
``stepped`` after each step; one record per step holds:

- ``t``, ``seconds``: the step's start (seconds since the trace began) and its wall time;
- ``gap_s``: from the end of the step before to this one's start (the calls, the outputs' delivery);
- ``rows``, ``chunk_tokens``, ``ctx_tokens``: decode rows, prompt tokens computed, and the batch's
  context (tokens of every sequence in it);
- ``joined``: sequences in this batch that were in none of the previous step's (a request joining);
  ``new_rows``: the first step at this number of rows (a batch shape not seen before);
- ``calls``, ``calls_s``: engine calls run on the thread since the step before (reserve,
  add_prefilled, release, abort...) and their seconds;
- ``gc``: Python collections that started since the step before ended, as ``[generation, seconds]``
  (``gc.callbacks``: a collection on any thread stops this one too);
- ``engine_cpu_s``: this thread's CPU time in the step; ``loop_cpu_s``: the main thread's (the
  servers' event loop: gRPC streams, sessions); ``other_cpu_s``: the rest of the process's (CacheStore
  receivers, gRPC's core); ``wait_s``: wall time none of the process's threads ran (the core was
  taken by another process: a loaded box);
- ``faults``: page faults this thread took in the step (first touches of memory: e.g. KV blocks whose
  pages this process had not mapped yet);
- ``pending``: requests holding blocks but not yet in the batch (a decode's reservations: KV on its
  way), ``waiting_join``: requests whose KV is in but that wait for room (a TBT bound);
- one key per probe (``probes``: name -> a function returning a running total, e.g. the
  CacheStore's bytes received, safe to call from the engine thread): its increase over the step
  (NaN when it raised).

Not thread-safe: the engine thread writes, others read ``records()`` (a copy) after it stopped or
accept a snapshot that may miss the newest step.
"""

from __future__ import annotations

import gc
import json
import math
import resource
import threading
import time
from collections import deque
from typing import Any, Callable

from .step_budget import StepShape

_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)  # Linux


def _thread_faults() -> int:
    """Page faults (minor and major) of the calling thread so far (0 where the platform cannot say)."""
    if _RUSAGE_THREAD is None:
        return 0
    usage = resource.getrusage(_RUSAGE_THREAD)
    return usage.ru_minflt + usage.ru_majflt


def _thread_clock(thread: threading.Thread) -> Callable[[], float]:
    """A CPU-time clock of ``thread`` (0.0 when the platform has none)."""
    try:
        clock = time.pthread_getcpuclockid(thread.ident or 0)
    except (AttributeError, OSError):
        return lambda: 0.0
    return lambda: time.clock_gettime(clock)


class StepTrace:
    def __init__(self, capacity: int, probes: dict[str, Callable[[], float]] | None = None):
        if capacity <= 0:
            raise ValueError(f"a step trace keeps at least one step, got capacity {capacity}")
        self.records_kept: deque[dict[str, Any]] = deque(maxlen=capacity)
        self.probes = dict(probes or {})
        self._origin = time.perf_counter()
        self._gcs: list[tuple[int, float]] = []  # (generation, seconds) of the collections since the last step
        self._gc_start = 0.0
        self._calls, self._calls_s = 0, 0.0
        self._last_end = self._origin
        self._last_ids: frozenset[str] = frozenset()
        self._rows_seen: set[int] = set()
        self._loop_clock = _thread_clock(threading.main_thread())
        self._before: tuple[float, ...] = ()
        self._probe_before: dict[str, float] = {}
        self._faults_before = 0
        gc.callbacks.append(self._on_gc)

    def close(self) -> None:
        """Stop timing collections (the records stay)."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start:
            self._gcs.append((int(info.get("generation", -1)), time.perf_counter() - self._gc_start))
            self._gc_start = 0.0

    def calls_done(self, count: int, seconds: float) -> None:
        """The engine thread ran ``count`` queued calls in ``seconds`` before the next step."""
        self._calls += count
        self._calls_s += seconds

    def begin(self) -> None:
        """Just before a step: the clocks and probes it is measured against."""
        self._before = (time.perf_counter(), time.thread_time(), time.process_time(), self._loop_clock())
        self._faults_before = _thread_faults()
        self._probe_before = {name: self._probe(name) for name in self.probes}

    def _probe(self, name: str) -> float:
        """A probe's running total; NaN when it raised (a debug record never stops the engine)."""
        try:
            return float(self.probes[name]())
        except Exception:  # noqa: BLE001 - any probe error: no figure for this step
            return math.nan

    def stepped(self, shape: StepShape | None, pending: int = 0, waiting_join: int = 0) -> None:
        """Just after the step ``begin`` opened; ``shape``: its batch (``EngineCore.last_shape``)."""
        end, engine_cpu, process_cpu, loop_cpu = (time.perf_counter(), time.thread_time(), time.process_time(),
                                                  self._loop_clock())
        start, engine0, process0, loop0 = self._before
        shape = shape or StepShape()
        wall, cpu, mine, loop = end - start, process_cpu - process0, engine_cpu - engine0, loop_cpu - loop0
        rec: dict[str, Any] = {
            "t": round(start - self._origin, 6), "seconds": round(wall, 6), "gap_s": round(start - self._last_end, 6),
            "rows": shape.rows, "chunk_tokens": shape.chunk_tokens, "ctx_tokens": shape.ctx_tokens,
            "joined": len(shape.ids - self._last_ids), "new_rows": shape.rows not in self._rows_seen,
            "calls": self._calls, "calls_s": round(self._calls_s, 6),
            "gc": [[g, round(s, 6)] for g, s in self._gcs],
            "engine_cpu_s": round(mine, 6), "loop_cpu_s": round(loop, 6),
            "other_cpu_s": round(max(0.0, cpu - mine - loop), 6), "wait_s": round(max(0.0, wall - cpu), 6),
            "faults": _thread_faults() - self._faults_before, "pending": pending, "waiting_join": waiting_join,
        }
        for name in self.probes:
            rec[name] = self._probe(name) - self._probe_before.get(name, 0.0)
        self.records_kept.append(rec)
        self._rows_seen.add(shape.rows)
        self._last_ids, self._last_end = shape.ids, end
        self._gcs, self._calls, self._calls_s = [], 0, 0.0

    def records(self) -> list[dict[str, Any]]:
        return list(self.records_kept)

    def dump(self, path: str) -> int:
        """The records as JSON lines in ``path``; how many."""
        records = self.records()
        with open(path, "w") as f:
            for rec in records:
                f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        return len(records)

