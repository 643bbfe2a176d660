"""LSO eviction on a decode (QLM's "Lazy eviction of Slow Objects", part 5 of the SLO queue).

When a batch request's place in the running batch makes an interactive request miss its time
between tokens, the decode evicts the batch request's KV to host memory (``engine/swap.py``)
and restores it later, without recomputation: greedy output is identical.

Lifecycle of one request here: the Session's ``Start`` says its class's TBT target
(``tbt_target_ms``, 0: none) and whether it may be evicted (``evictable``: a class with neither
a TTFT nor a TBT target, i.e. batch / best effort); the session ``track``s it when it joins
the batch and ``untrack``s it when it ends (an evicted request that ends, e.g. its client
left, is aborted by the engine, which drops its host copy). After every engine step the
engine thread calls the controller, which asks ``decide`` (pure) and evicts or restores one
request at most.

``decide``, from the measured step time (an EWMA of seconds per step):
- **evict** the newest evictable running request when an interactive (TBT-targeted) request
  runs and a step takes longer than the tightest TBT target, at most once per ``cooldown``
  steps (the EWMA must see the smaller batch first);
- **restore** the first-evicted request when no TBT-targeted request runs, or when the step
  time predicted with one more request (linear in the batch) stays under ``restore_margin``
  of the tightest target, ``cooldown`` steps after the last eviction; a restore that finds no
  free blocks leaves it swapped (tried again next step).

(A test hook may give every step a minimum duration, ``step_floor_s``: by default
pdserve/test_hooks.py's DECODE_STEP_FLOOR_ENV. Every engine step with a running batch then lasts at
least that long: the engine thread waits out the rest before the step's tokens go out, and the
controller measures the padded step, so a test can miss the smallest TBT target a class can state
(1 ms) on any CPU, however fast. Off: one comparison per step.)
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from pdserve.test_hooks import decode_step_floor_s

log = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class Hint:
    tbt_s: float | None  # the class's TBT target; None: none
    evictable: bool


@dataclass(frozen=True, slots=True)
class Decision:
    action: str  # "evict" | "restore"
    request_id: str


def decide(step_s: float | None, running: list[tuple[str, Hint | None]], swapped: list[str], steps_since_evict: int,
           cooldown: int = 4, restore_margin: float = 0.7) -> Decision | None:
    """What to do after a step (see the module docstring). ``running``: the batch in arrival
    order with each request's hint (None: untracked, never evicted); ``swapped``: evicted
    requests, the first evicted first."""
    targets = [h.tbt_s for _, h in running if h is not None and h.tbt_s is not None and not h.evictable]
    tightest = min(targets) if targets else None
    evictable = [rid for rid, h in running if h is not None and h.evictable]
    if tightest is not None and evictable and step_s is not None and step_s > tightest:
        if steps_since_evict >= cooldown:
            return Decision("evict", evictable[-1])
        return None
    if not swapped or steps_since_evict < cooldown:
        return None
    if tightest is None:
        return Decision("restore", swapped[0])
    n = len(running)
    if step_s is not None and n and step_s * (n + 1) / n <= restore_margin * tightest:
        return Decision("restore", swapped[0])
    return None


class LsoController:
    """Runs ``decide`` on the engine thread after every step (``AsyncLLMEngine.after_step``)."""

    def __init__(self, metrics=None, alpha: float = 0.3, cooldown: int = 4, restore_margin: float = 0.7,
                 step_floor_s: float | None = None):
        self.metrics, self.alpha, self.cooldown, self.restore_margin = metrics, alpha, cooldown, restore_margin
        self.step_floor_s = decode_step_floor_s() if step_floor_s is None else step_floor_s  # test hook (docstring)
        self._hints: dict[str, Hint] = {}
        self._lock = threading.Lock()  # hints are written on the event loop, read on the engine thread
        self.step_s: float | None = None
        self._since_evict = cooldown
        if metrics is not None:  # both series exist from the start (a panel shows 0, not "no data")
            for action in ("evict", "restore"):
                metrics.kv_evictions.labels(action=action)

    def track(self, request_id: str, tbt_target_ms: int, evictable: bool) -> None:
        if tbt_target_ms <= 0 and not evictable:
            return  # nothing to protect, nothing to evict
        with self._lock:
            self._hints[request_id] = Hint(tbt_target_ms / 1000.0 if tbt_target_ms > 0 else None, evictable)

    def untrack(self, request_id: str) -> None:
        with self._lock:
            self._hints.pop(request_id, None)

    def __call__(self, engine, seconds: float, batch: int) -> None:
        if batch and self.step_floor_s > seconds:  # test hook (docstring)
            time.sleep(self.step_floor_s - seconds)
            seconds = self.step_floor_s
        if batch:
            self.step_s = seconds if self.step_s is None else (1 - self.alpha) * self.step_s + self.alpha * seconds
            self._since_evict += 1
        swapped = engine.swapper.swapped_ids()
        with self._lock:
            if not self._hints and not swapped:
                return
            running = [(s.request_id, self._hints.get(s.request_id)) for s in engine.running]
        if not batch and not running:
            self._since_evict = max(self._since_evict, self.cooldown)  # idle: nothing to protect any more
        d = decide(self.step_s, running, swapped, self._since_evict, self.cooldown, self.restore_margin)
        if d is None:
            return
        if d.action == "evict":
            moved = engine.swapper.evict(d.request_id)
            self._since_evict = 0
            log.info("evicted %s to host memory (%d bytes): a step takes %.1f ms, over an interactive TBT target",
                     d.request_id, moved, 1000 * (self.step_s or 0))
            if self.metrics is not None:
                self.metrics.kv_evictions.labels(action="evict").inc()
        elif engine.swapper.restore(d.request_id):
            log.info("restored %s from host memory", d.request_id)
            if self.metrics is not None:
                self.metrics.kv_evictions.labels(action="restore").inc()
        if self.metrics is not None:
            self.metrics.kv_swapped_requests.set(len(engine.swapper.swapped_ids()))
            self.metrics.kv_swapped_bytes.set(engine.swapper.swapped_bytes())
