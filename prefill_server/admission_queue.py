"""AdmissionQueue: requests wait here, first come first served or in the order of an SLO
policy, while every decode is too full for them (asyncio only, no I/O).

A full decode is a reason to wait, not to fail. Each request's ``RequestConductor``
(``conductor.py``) holds one ``Ticket`` (its place in line is its arrival)::

    ticket = queue.ticket(request_id, deadline)
    await ticket.turn()    # at once when nobody waits ahead; else in line until its turn
    ...                    # try the decodes; while queued it is the head, the rest wait behind it
    ticket.leave()         # a decode allocated (or the request ended): the next one goes at once
    await ticket.wait()    # every decode (or prefill's own pool) was full: wait for a change
    ticket.started()       # its first token reached the client: out of the line, its wait is over

Only the head of the queue tries the decodes (strict FIFO: a small request does not
overtake a large one forever). It tries again when ``notify()`` says that KV blocks may
have been freed (a decode's load report arrived; a request on this prefill ended), every
``recheck_s`` in any case, and at once when it becomes the head. A request that does not
have to wait never enters the queue (when the queue is empty, requests go straight on).

Limits, each a clear error:
- ``max_length`` requests may wait; one more that would have to wait gets ``QueueFull``
  (HTTP 429, code ``queue_full``; gRPC RESOURCE_EXHAUSTED);
- a request waits until ``deadline`` (its end-to-end deadline, a little before it so the
  client learns why: ``QueueTimeout`` -> HTTP 504 ``request_timeout``) or ``max_wait_s``
  (``--queue-timeout``, off by default: ``QueueTimeout`` with ``by_deadline`` False -> 503);
- a client that goes away cancels the request's task: its ticket leaves at once (``leave``
  runs in the conductor's ``finally``); a request cancelled while it waits in line (its
  deadline, or its client) says how long it waited on that cancellation
  (``note_waited_in_line``), which the Frontend reads back (``waited_in_line``) to name the
  queue in its deadline message;
- ``wait(until=...)`` bounds one wait by the caller's own limit instead of ``max_wait_s``
  (a resumed request's ``--resume-wait``): ``QueueTimeout`` with ``by_deadline`` False.

Re-entry: a ticket that left (a decode allocated, or its first token came: ``started``) may
wait again: a Retryable failure after the allocation, or a resume after its decode failed
mid-generation (``conductor.py``). ``wait`` (or ``turn``) puts it back in line at its
original arrival position (its ``seq``): it is older than every request that arrived after
it, so it goes ahead of them, never ahead of an older one still waiting. After ``started``
its next wait is a new one: ``waited()`` and ``max_wait_s`` count from when it re-enters (not
from its first wait, which ended long ago). With an SLO queue, a re-entering request that
the policy already admitted (its ``SloRequest`` is running) goes ahead of the policy's line,
the oldest such one first: the policy chose it once and its client is mid-stream; it stays
counted as running there (no second admission, no second queue-time sample).

``length`` (the ``pdserve_requests_queued`` gauge) is reported through ``on_length`` on every
change.

With an SLO queue (``slo``, a ``pdserve.slo.GlobalQueue``; ``--queue-policy fifo|edf|qlm``) the
line is in its policy's order instead of arrival order: each ticket carries its request's
``SloRequest``; joining the line is ``GlobalQueue.wait``, leaving it ``leave`` (or ``admitted``:
``Ticket.admitted`` when a decode allocated), and the head is ``GlobalQueue.head()``. A new
arrival that the policy puts first is the head at once; whenever the policy's order has a new
head (also when only time changed qlm's order) the queue calls its ``SloRequest.wakeup``,
which wakes its ticket.

Room (``room``, set by the prefill's wiring with an ordering policy): whether one more request
may go on now, i.e. our engine's own line (remote prefills it has not computed yet, in arrival
order) holds less than a step's budget of prompt tokens (``EngineLine.has_room``, engine_line.py). With it,
``turn`` lets a request through only when there is room, even when nobody waits: the others wait
in this line, in the policy's order, and each prompt our engine computes ``notify``s the head.
Without it (fifo) every request goes on into our engine's line, which keeps arrival order anyway.
A head waiting for room in ``turn`` ends its wait at its deadline (``QueueTimeout``) as any
wait in line does.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from typing import TYPE_CHECKING, Callable

from .decode_session import NoDecodeAvailable

if TYPE_CHECKING:
    from pdserve.slo import GlobalQueue, SloRequest

# The queue gives up this much before the request's deadline, so its own message (why the
# request timed out) reaches the client before the Frontend's deadline cancels the request.
DEADLINE_MARGIN_S = 0.1
RECHECK_S = 0.25


class QueueFull(NoDecodeAvailable):
    """The admission queue already holds ``max_length`` requests: HTTP 429 / RESOURCE_EXHAUSTED."""


class RequestTooLarge(NoDecodeAvailable):
    """The request needs more KV blocks than any decode (or this prefill) holds in all: no wait
    helps. HTTP 413 / gRPC INVALID_ARGUMENT, at once."""


class QueueTimeout(Exception):
    """The request waited in the queue until its deadline (``by_deadline``) or ``max_wait_s``."""

    def __init__(self, message: str, by_deadline: bool):
        super().__init__(message)
        self.by_deadline = by_deadline


class AdmissionQueue:
    def __init__(self, max_length: int, *, max_wait_s: float | None = None, recheck_s: float = RECHECK_S,
                 on_length: Callable[[int], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 slo: GlobalQueue | None = None, room: Callable[[], bool] | None = None):
        if max_length < 0:
            raise ValueError(f"max_length must be >= 0, got {max_length}")
        if max_wait_s is not None and not max_wait_s > 0:
            raise ValueError(f"max_wait_s must be > 0 or None, got {max_wait_s}")
        self.max_length, self.max_wait_s, self.recheck_s = max_length, max_wait_s, recheck_s
        self.on_length, self.clock = on_length, clock
        self._waiting: list[Ticket] = []  # in arrival order (Ticket.seq)
        self._seq = itertools.count()
        self.slo = slo  # its policy orders the line (None: arrival order)
        self._by_request: dict[str, Ticket] = {}  # with slo: request id -> its ticket in line
        self._readmitted: list[Ticket] = []  # with slo: re-entered tickets the policy admitted once (seq order)
        self.room = room  # may one more request go on now (room in our engine's line)? None: always

    def has_room(self) -> bool:
        return self.room is None or self.room()

    def __len__(self) -> int:
        return len(self._waiting)

    def ticket(self, request_id: str, deadline: float | None = None, slo: SloRequest | None = None) -> Ticket:
        """A place in line for a request arriving now; ``deadline`` in ``clock()`` seconds; ``slo``:
        its request in the SLO queue (its class, its estimate)."""
        t = Ticket(self, next(self._seq), request_id, deadline, slo if self.slo is not None else None)
        if t.slo is not None:
            t.slo.wakeup = t._wake  # the policy's order has it first now
        return t

    def notify(self) -> None:
        """KV blocks may have been freed somewhere: the head tries again."""
        head = self._head()
        if head is not None:
            head._wake()

    def _head(self) -> Ticket | None:
        if not self._waiting:
            return None
        if self._readmitted:  # ahead of the policy's line (module docstring, "Re-entry")
            return self._readmitted[0]
        if self.slo is not None:
            first = self.slo.head()
            if first is not None and first.request_id in self._by_request:
                return self._by_request[first.request_id]
        return self._waiting[0]  # arrival order (or a ticket without an SLO request)

    def _join(self, t: Ticket, full: bool) -> None:
        if len(self._waiting) >= self.max_length:
            raise QueueFull(f"the admission queue is full ({self.max_length} requests wait for a decode with free "
                            f"KV blocks; --max-queued-requests)")
        bisect.insort(self._waiting, t, key=lambda w: w.seq)
        if t.queued_at is None:
            t.queued_at = self.clock()
        if t.slo is not None and self.slo is not None:  # (a ticket has an SLO request only with an SLO queue)
            self._by_request[t.request_id] = t
            if t.slo.state == "running":  # re-entering after the policy admitted it (a resume)
                bisect.insort(self._readmitted, t, key=lambda w: w.seq)
            self.slo.wait(t.slo, full)  # nothing if it is running
            self._head()  # the policy places it (a new head is woken)
        self._changed()

    def _remove(self, t: Ticket) -> None:
        was_head = self._head() is t
        self._waiting.remove(t)
        if t in self._readmitted:
            self._readmitted.remove(t)
        if t.slo is not None and self.slo is not None:
            self._by_request.pop(t.request_id, None)
            self.slo.leave(t.slo)  # nothing if it was admitted
        head = self._head()
        if was_head and head is not None:
            head._wake()  # there may be room for the next one too
        self._changed()

    def _changed(self) -> None:
        if self.on_length is not None:
            self.on_length(len(self._waiting))


class Ticket:
    """One request's place in line (see the module docstring)."""

    __slots__ = ("queue", "seq", "request_id", "deadline", "slo", "queued_at", "_queued", "_woken", "_event")

    def __init__(self, queue: AdmissionQueue, seq: int, request_id: str, deadline: float | None,
                 slo: SloRequest | None = None):
        self.queue, self.seq, self.request_id, self.deadline, self.slo = queue, seq, request_id, deadline, slo
        self.queued_at: float | None = None  # when its current wait began (its first, or the one after ``started``)
        self._queued = False
        self._woken = False
        self._event = asyncio.Event()

    @property
    def queued(self) -> bool:
        return self._queued

    def waited(self) -> float:
        """Seconds since its current wait began (0 if it never had to wait)."""
        return 0.0 if self.queued_at is None else self.queue.clock() - self.queued_at

    def is_head(self) -> bool:
        return self._queued and self.queue._head() is self

    async def turn(self) -> None:
        """Return when this request may try the decodes: at once if nobody waits ahead of it."""
        q = self.queue
        if self._queued:
            if not (self.is_head() and q.has_room()):
                await self._until(head_only=True)
            return
        if q.has_room() and (not q._waiting or (q.slo is None and q._waiting[0].seq > self.seq)):  # nobody ahead
            return
        self._enter(full=q.has_room())  # behind others waiting for the decodes, or for room in our engine
        await self._until(head_only=True)

    async def wait(self, until: float | None = None) -> None:
        """Every decode was too full: wait in line until this request is the head and KV blocks
        may have been freed (or ``recheck_s`` passed). Raises QueueFull, QueueTimeout.

        ``until`` (``clock()`` seconds): the caller's own limit on this wait, in place of the
        queue's ``max_wait_s`` (the request's deadline still applies when it comes first)."""
        if not self._queued:
            self._enter()
        await self._until(head_only=False, until=until)

    def admitted(self) -> None:
        """A decode allocated the request: the SLO queue counts it as running; out of the line."""
        if self.slo is not None and self.queue.slo is not None:
            self.queue.slo.admitted(self.slo)
        self.leave()

    def leave(self) -> None:
        """Out of the queue (allocated, failed, cancelled); idempotent."""
        if self._queued:
            self._queued = False
            self.queue._remove(self)

    def started(self) -> None:
        """The request's first token reached the client: out of the queue, and its wait is over;
        should it wait again (a resume), that is a new wait (module docstring, "Re-entry")."""
        self.leave()
        self.queued_at = None

    def _enter(self, full: bool = True) -> None:
        """Into the line; ``full``: because the decodes are (not for room in our engine's line)."""
        self.queue._join(self, full)
        self._queued = True
        self._woken = False

    def _wake(self) -> None:
        self._woken = True
        self._event.set()

    def _limit(self, until: float | None = None) -> tuple[float | None, bool]:
        """When waiting must end, and whether that is the request's deadline."""
        q = self.queue
        by_deadline = None if self.deadline is None else self.deadline - DEADLINE_MARGIN_S
        by_cap: float | None
        if until is not None:
            by_cap = until
        else:
            by_cap = None if q.max_wait_s is None or self.queued_at is None else self.queued_at + q.max_wait_s
        if by_cap is None or (by_deadline is not None and by_deadline <= by_cap):
            return by_deadline, True
        return by_cap, False

    async def _until(self, head_only: bool, until: float | None = None) -> None:
        q = self.queue
        while True:
            limit, by_deadline = self._limit(until)
            now = q.clock()
            expired = limit is not None and now >= limit
            # a wait whose limit passed ends even if a notify came meanwhile (a stream of
            # load reports must not keep it trying past its limit)
            if self.is_head() and ((head_only and q.has_room()) or (not head_only and self._woken and not expired)):
                self._woken = False
                return
            if expired:
                raise self._timeout(by_deadline, until is not None, for_room=head_only and not q.has_room())
            timeout = None if limit is None else limit - now
            if self.is_head():  # re-check now and then: a missed notify, prefill's own pool
                timeout = q.recheck_s if timeout is None else min(timeout, q.recheck_s)
            self._event.clear()
            try:
                async with asyncio.timeout(timeout):
                    await self._event.wait()
            except asyncio.TimeoutError:
                if self.is_head() and (limit is None or q.clock() < limit):
                    self._woken = True

    def _timeout(self, by_deadline: bool, by_caller: bool = False, for_room: bool = False) -> QueueTimeout:
        waited = self.waited()
        if by_deadline:
            return QueueTimeout(deadline_message(self.request_id, waited), True)
        if by_caller:
            return QueueTimeout(f"request {self.request_id} waited {waited:.1f}s in the admission queue until the "
                                f"limit of this wait", False)
        what = ("room in the prefill's engine (a step's budget of prompt tokens, --max-num-batched-tokens, is queued "
                "there)") if for_room else "a decode with enough free KV blocks"
        return QueueTimeout(f"request {self.request_id} waited {waited:.1f}s in the admission queue for {what} "
                            f"(--queue-timeout)", False)


def deadline_message(request_id: str, waited: float) -> str:
    """Why a request that was still waiting in the queue when its deadline came timed out (504)."""
    return (f"request {request_id} waited {waited:.1f}s in the admission queue for a decode with enough free KV "
            f"blocks until its deadline (--request-timeout, or the client's X-Request-Timeout / gRPC deadline)")


_WAITED_IN_LINE = "waited_in_line_s"  # the attribute a cancellation in line carries


def note_waited_in_line(cancel: BaseException, waited: float) -> None:
    """A request was cancelled while it waited in line: its cancellation carries how long it waited."""
    setattr(cancel, _WAITED_IN_LINE, waited)


def waited_in_line(error: BaseException) -> float | None:
    """Seconds the request had waited in line when ``error`` ended it there (the cancellation, or the
    TimeoutError ``asyncio.timeout`` raises from it); None when it was not waiting in line."""
    for exc in (error, error.__cause__):
        waited = getattr(exc, _WAITED_IN_LINE, None)
        if waited is not None:
            return waited
    return None
