"""GlobalQueue: the front door's view of its requests, by SLO class (pure: no I/O, no asyncio).

The front door (the prefill; a router later) tells it what happens to each request and asks
it two things: may this request come in at all (early rejection), and who goes next.

    req = q.arrive(request_id, cls, prompt_tokens, max_tokens)  # may raise Rejected (429)
    q.wait(req)            # it has to wait (the backend is full): joins the waiting set
    q.head()               # the waiting request the policy sends next (fifo | edf | qlm)
    q.leave(req)           # it stops waiting without being admitted (tries again, gives up)
    q.admitted(req)        # it left the queue: a decode allocated its KV (now running)
    q.token(req, n)        # n tokens reached the client (the first one ends its prefill)
    q.finish(req, outcome) # ok | error | cancelled, exactly once (later calls are ignored)

Estimates (``estimator.py``): at arrival each request gets the estimate of its wait, prefill
and decode at the place the policy gives it now; its error against what happened is
exported (``pdserve_slo_estimate_error_seconds``, part=queue when it leaves the queue,
part=e2e when it finishes) and kept for ``snapshot()``.

Early rejection (classes with ``earlyReject``): a request whose SLO would be missed even if
it were served next (the running requests free the first slot, then its own prefill and
decode; ``TTFT`` and end-to-end targets, the ones a queue can change) raises ``Rejected``
at once, with the estimate and a ``retry_after_s`` (the excess over its target, at least a
second). Only once the estimator is warm (it has seen prefills, decodes, output lengths).

Metrics and the records of finished requests: ``accounting.py``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from .accounting import SloAccounting
from .classes import SloClass, SloClasses
from .estimator import Estimate, Estimator, Job
from .groups import Waiting
from .policies import POLICIES, Context, order

if TYPE_CHECKING:
    from pdserve.metrics import ServerMetrics

REORDER_AFTER_S = 0.5  # qlm: the order is recomputed after changes, and when this old
QLM_MIN_INTERVAL_S = 0.05  # qlm: at most one full decision this often; between, arrivals go in by EDF


class Rejected(Exception):
    """Early rejection: the request cannot meet its SLO even if served next (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: int, estimate: Estimate):
        super().__init__(message)
        self.retry_after_s, self.estimate = retry_after_s, estimate


@dataclass(eq=False)
class SloRequest(Waiting):
    estimate: Estimate | None = None
    state: str = "new"  # new -> waiting -> running -> done (waiting is skipped when it need not wait)
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    tokens: int = 0
    verdict: dict = field(default_factory=dict)
    wakeup: Callable[[], None] | None = None  # called when it becomes first in line (the front door wakes it)
    inputs: dict = field(default_factory=dict)  # what the estimate at arrival was made from


class GlobalQueue:
    def __init__(self, classes: SloClasses, policy: str = "fifo", metrics: ServerMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic, estimator: Estimator | None = None,
                 on_change: Callable[[], None] | None = None, kv_capacity: Callable[[], int] | None = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown queue policy {policy!r}; known: {', '.join(POLICIES)}")
        self.classes, self.policy, self.clock = classes, policy, clock
        self.on_change = on_change  # the waiting set changed (a waiter may be the head now)
        self.kv_capacity = kv_capacity  # the decodes' KV blocks in all (0: not known yet): plans count blocks
        self.prefill_bound = False  # the line waits for this prefill's compute too (its slots): plans count it
        self.estimator = estimator or Estimator()
        self.arrived: dict[str, SloRequest] = {}  # trying the decodes now, neither waiting nor admitted
        self.waiting: dict[str, SloRequest] = {}
        self.running: dict[str, SloRequest] = {}
        self.account = SloAccounting(classes, metrics)
        self._seq = 0
        self._order: list[SloRequest] = []
        self._ordered_at = -math.inf
        self._dirty = self._patched = False
        self._freed_at: float | None = None  # a running request ended while others waited

    # -- the request's life ----------------------------------------------------------------
    def arrive(self, request_id: str, cls: SloClass, prompt_tokens: int, max_tokens: int,
               blocks: int = 1, cached_tokens: int = 0) -> SloRequest:
        """A request arrived; ``blocks``: the KV blocks a decode reserves for it; ``cached_tokens``: its
        leading prompt tokens the prefill's prefix cache holds now (0: unknown). May raise Rejected."""
        now = self.clock()
        self._seq += 1
        job = Job(cls.name, prompt_tokens, max_tokens, max(1, blocks), max(0, min(cached_tokens, prompt_tokens)))
        req = SloRequest(request_id, cls, now, self._seq, job)
        if cls.early_reject and self.estimator.warm:
            self._maybe_reject(req)
        req.estimate = self._estimate_in_line(req)
        self.arrived[request_id] = req
        return req

    def wait(self, req: SloRequest, full: bool = True) -> None:
        """``req`` has to wait for room (idempotent); ``full``: the backend (the decodes) is full,
        not only this prefill's slots, so the running requests are its K."""
        if req.state != "new":
            return
        req.state = "waiting"
        if full:
            self.estimator.observe_full(len(self.running))
        self.arrived.pop(req.request_id, None)
        self.waiting[req.request_id] = req
        self._changed(req.cls)

    def leave(self, req: SloRequest) -> None:
        """``req`` stops waiting without being admitted (it is trying again, or giving up)."""
        if req.state == "waiting":
            req.state = "new"
            del self.waiting[req.request_id]
            self.arrived[req.request_id] = req
            self._changed(req.cls)

    def admitted(self, req: SloRequest) -> None:
        """``req`` left the queue: the backend took it (idempotent)."""
        if req.state not in ("new", "waiting"):
            return
        was_waiting = req.state == "waiting"
        req.state, req.admitted_at = "running", self.clock()
        self.waiting.pop(req.request_id, None)
        self.arrived.pop(req.request_id, None)
        self.running[req.request_id] = req
        waited = req.admitted_at - req.arrival
        if was_waiting and self._freed_at is not None:  # room freed -> this one in
            self.estimator.observe_lag(req.admitted_at - self._freed_at)
            self._freed_at = None
        self.account.admitted(req, waited)
        if was_waiting:
            self._changed(req.cls)

    def token(self, req: SloRequest, n: int = 1) -> None:
        now = self.clock()
        if req.first_token_at is None:
            req.first_token_at = now
            if req.admitted_at is not None:
                self.estimator.observe_prefill(req.job.computed_tokens, req.first_token_at - req.admitted_at)
        else:
            self.estimator.observe_gap(now, n, now - req.last_token_at)
        req.last_token_at = now
        req.tokens += n

    def finish(self, req: SloRequest, outcome: str = "ok") -> None:
        """The request ended: ok | error | cancelled (once; later calls are ignored)."""
        if req.state == "done":
            return
        was_waiting = req.state == "waiting"
        if req.state == "running" and self.waiting:
            self._freed_at = self.clock()  # room for whoever waits
        req.state = "done"
        self.arrived.pop(req.request_id, None)
        self.waiting.pop(req.request_id, None)
        self.running.pop(req.request_id, None)
        now = self.clock()
        e2e = now - req.arrival
        ttft = None if req.first_token_at is None else req.first_token_at - req.arrival
        if outcome == "ok":
            self.estimator.observe_output(req.cls.name, req.tokens, req.tokens >= req.job.max_tokens)
            req.verdict = req.cls.verdict(ttft, e2e, req.tokens)
        elif outcome == "error":
            req.verdict = dict.fromkeys(req.cls.targets, False)
        self.account.finished(req, outcome, ttft, e2e)
        if was_waiting:
            self._changed(req.cls)

    # -- who goes next -----------------------------------------------------------------------
    def order(self) -> list[SloRequest]:
        """The waiting requests in the order the policy serves them. A full decision after every
        change (qlm: at most every QLM_MIN_INTERVAL_S, and at least every REORDER_AFTER_S
        while requests wait; in between, the last order without those gone and with the new
        arrivals put in by EDF)."""
        now = self.clock()
        since = now - self._ordered_at
        qlm = self.policy == "qlm"
        if self._dirty or self._patched or (qlm and self.waiting and since > REORDER_AFTER_S):
            before = self._order[0] if self._order else None
            waiting = list(self.waiting.values())
            if qlm and since < QLM_MIN_INTERVAL_S:
                if self._dirty:
                    self._order, self._patched = self._patch(self._order, waiting), True
            else:
                self._order = self._ordered(waiting, now) if len(waiting) > 1 else waiting
                self._ordered_at, self._patched = now, False
            self._dirty = False
            head = self._order[0] if self._order else None
            if head is not None and head is not before and head.wakeup is not None:
                head.wakeup()  # a new head (also when only time changed qlm's order): it tries now
        return self._order

    def _patch(self, ordered: list[SloRequest], waiting: list[SloRequest]) -> list[SloRequest]:
        """``ordered`` without the requests no longer in ``waiting``, the new ones put in by EDF
        (before the first request with a later deadline; fifo: at the end)."""
        keep = {id(w) for w in waiting}
        out = [w for w in ordered if id(w) in keep]
        known = {id(w) for w in out}
        for new in sorted((w for w in waiting if id(w) not in known), key=lambda w: w.seq):
            if self.policy == "fifo":
                out.append(new)
                continue
            key = (new.cls.deadline(new.arrival), new.seq)
            at = next((i for i, w in enumerate(out) if (w.cls.deadline(w.arrival), w.seq) > key), len(out))
            out.insert(at, new)
        return out

    def head(self) -> SloRequest | None:
        ordered = self.order()
        return ordered[0] if ordered else None

    def context(self, now: float | None = None) -> Context:
        """What the plans see now: when each running request frees what it holds, the capacity
        (the decodes' KV blocks when known, else K slots); with ``prefill_bound``, also this
        prefill's one engine: when each prompt admitted and not computed yet will be, one after
        another in admission order."""
        now = self.clock() if now is None else now
        running = list(self.running.values())
        engine = None
        if self.prefill_bound:
            computing = sorted((r for r in running if r.first_token_at is None), key=lambda r: r.admitted_at or now)
            ends, t = [], 0.0
            for r in computing:
                since = max(0.0, now - (r.admitted_at or now))
                t += max(0.0, self.estimator.prefill_time(r.job.computed_tokens) - since)
                ends.append(t)
            engine = tuple(ends)
        frees = tuple(self.estimator.remaining(r.job, r.tokens) for r in running)
        blocks = self.kv_capacity() if self.kv_capacity is not None else 0
        if blocks > 0:
            return Context(now, self.estimator, frees, blocks, tuple(r.job.blocks for r in running), by_blocks=True,
                           engine=engine)
        return Context(now, self.estimator, frees, self.estimator.capacity(len(running), bool(self.waiting)),
                       engine=engine)

    def _ordered(self, waiting: list[SloRequest], now: float) -> list[SloRequest]:
        """A full decision of the policy (its cost observed)."""
        started = time.perf_counter()
        out = order(self.policy, waiting, self.context(now))
        self.account.decision(time.perf_counter() - started)
        return out

    # -- estimates and rejection ------------------------------------------------------------
    def _estimate_in_line(self, req: SloRequest) -> Estimate:
        """Its estimate at the place the policy would give it if it had to wait now, behind the
        requests trying the decodes right now."""
        pending = sorted(self.arrived.values(), key=lambda w: w.seq)
        line = pending + self._patch(self.order(), list(self.waiting.values()) + [req])
        ctx = self.context(req.arrival)
        est = self.estimator
        req.inputs = {"ahead": line.index(req), "running": len(ctx.frees_in), "capacity": ctx.slots,
                      "per_token_s": est.per_token.value, "lag_s": est.lag.value,
                      "cached_tokens": req.job.cached_tokens}
        return ctx.plan([w.job for w in line])[line.index(req)]

    def _maybe_reject(self, req: SloRequest) -> None:
        """Rejected if even served next (behind only the requests trying the decodes now) it misses."""
        pending = sorted(self.arrived.values(), key=lambda w: w.seq)
        est = self.context(req.arrival).plan([w.job for w in pending + [req]])[-1]
        c, excess, parts = req.cls, 0.0, []
        if c.ttft_ms is not None and est.first_token * 1000 > c.ttft_ms:
            excess = max(excess, est.first_token - c.ttft_ms / 1000)
            parts.append(f"first token in {est.first_token:.2f}s (target {c.ttft_ms} ms)")
        if c.e2e_ms is not None and est.total * 1000 > c.e2e_ms:
            excess = max(excess, est.total - c.e2e_ms / 1000)
            parts.append(f"completion in {est.total:.2f}s (target {c.e2e_ms} ms)")
        if not parts:
            return
        retry = max(1, math.ceil(excess))
        req.estimate, req.state = est, "done"
        req.verdict = dict.fromkeys(c.targets, False)
        self.account.finished(req, "rejected", None, 0.0)
        raise Rejected(
            f"SLO class {c.name!r} cannot be met even if this request were served next: estimated wait "
            f"{est.wait:.2f}s + prefill {est.prefill:.2f}s + decode {est.decode:.2f}s (~{est.output_tokens:.0f} "
            f"tokens): {'; '.join(parts)}; {len(self.waiting)} waiting, {len(self.running)} running; "
            f"retry after {retry}s", retry, est)

    # -- bookkeeping -------------------------------------------------------------------------
    def _changed(self, cls: SloClass) -> None:
        self._dirty = True
        self.account.queued(cls, sum(1 for r in self.waiting.values() if r.cls is cls))
        if self.on_change is not None:
            self.on_change()

    def snapshot(self, recent: int = 64) -> dict:
        """For /debug/slo: policy, classes, waiting by class, the order, the estimator, the last
        ``recent`` finished requests (estimate at arrival vs actual)."""
        return {
            "policy": self.policy, "classes": [c.describe() for c in self.classes],
            "waiting": {c.name: sum(1 for r in self.waiting.values() if r.cls is c) for c in self.classes},
            "running": len(self.running), "order": [r.request_id for r in self.order()][:64],
            "estimator": self.estimator.snapshot(), "recent": self.account.recent(recent),
        }
