"""SloGate: the global SLO queue in the router, in front of every prefill (QLM's global scheduler).

Without a router each prefill orders its own admission queue by its SLO policy; with several
prefills behind a router, the router is the one place that sees every request, so the line is
kept here. Lifecycle of one request at the gate (``--slo-classes`` / ``--queue-policy``):

1. **class** - ``X-SLO-Class`` / the body's ``priority`` / gRPC ``x-slo-class``: a SloClass
   (unknown: 400 / INVALID_ARGUMENT naming the known ones, from ``SloClasses.select``).
2. **arrive** - ``GlobalQueue.arrive``: a class with ``earlyReject`` whose SLO cannot be met
   even if served next raises ``Rejected`` (429 + Retry-After, RESOURCE_EXHAUSTED).
3. **pass or wait** - when nobody waits here and some routable prefill reports an empty
   admission queue (``ServerLoad.queued``), at once. Otherwise it waits in the policy's order
   (fifo | edf | qlm); the head passes on a sign that room may exist: a relay ended since the
   last pass, or a prefill's load report, newer than the last pass, shows an empty admission
   queue (at most one pass per sign: a burst does not refill the prefills' own queues). Its
   deadline (``X-Request-Timeout``, the gRPC deadline, ``--request-timeout``) ends the wait
   with ``GateTimeout`` (504 naming the router's queue; DEADLINE_EXCEEDED).
4. **relay** - the router's usual choice of prefill; ``tokens(n)`` as they are relayed feed
   the estimator (the first ends the prefill).
5. **finish** - ``finish(outcome)`` exactly once (ok | error | cancelled): a sign of room.
   A client that leaves while waiting cancels the wait: it leaves the line at once.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from contextlib import asynccontextmanager

from pdserve.slo import GlobalQueue, SloClass, SloRequest

RECHECK_S = 0.05  # how often the head looks at the prefills' load reports while it waits


class GateTimeout(Exception):
    """The request's deadline passed while it waited in the router's SLO queue (504)."""


class SloGate:
    def __init__(self, queue: GlobalQueue, prefills, recheck_s: float = RECHECK_S):
        self.queue, self.prefills, self.recheck_s = queue, prefills, recheck_s
        self._last_pass = 0.0  # time.monotonic() of the last pass out of the line
        self._ended = 0        # relays ended since the last pass out of the line
        self._waiters: dict[str, asyncio.Event] = {}

    @property
    def classes(self):
        return self.queue.classes

    def waiting(self) -> int:
        return len(self.queue.waiting)

    def _room(self) -> bool:
        """Some routable prefill reports an empty admission queue in a report newer than the last pass."""
        return any(w.load.queued == 0 and w.load_at > self._last_pass for w in self.prefills.routable())

    @asynccontextmanager
    async def admission(self, request_id: str, cls: SloClass, prompt_tokens: int, max_tokens: int,
                        timeout_s: float):
        """Hold the request until it may go to a prefill (see the module docstring); yields a
        ``Passage`` whose ``tokens(n)`` / ``outcome`` the relay sets. Raises Rejected, GateTimeout."""
        q = self.queue
        req = q.arrive(request_id, cls, prompt_tokens, max_tokens)
        passage = Passage(q, req)
        try:
            if q.waiting or not self._room():
                try:
                    await self._wait(req, time.monotonic() + timeout_s)
                except GateTimeout:
                    passage.outcome = "error"
                    raise
            self._last_pass = time.monotonic()
            q.admitted(req)
            yield passage
        finally:
            self._waiters.pop(request_id, None)
            was_running = req.state == "running"
            if req.state == "waiting":
                q.leave(req)
            q.finish(req, passage.outcome)
            if was_running and q.waiting:
                self._ended += 1  # a sign of room for the head (none kept while nobody waits)
            elif not q.waiting:
                self._ended = 0
            self._wake_head()

    async def _wait(self, req: SloRequest, deadline: float) -> None:
        q = self.queue
        event = self._waiters[req.request_id] = asyncio.Event()
        req.wakeup = event.set
        q.wait(req)
        while True:
            if q.head() is req and (self._ended > 0 or self._room()):
                self._ended = max(0, self._ended - 1)
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise GateTimeout(f"request {req.request_id} waited {time.monotonic() - req.arrival:.1f}s in the "
                                  f"router's SLO queue ({q.policy}) for a prefill with room until its deadline "
                                  f"(--request-timeout, or the client's X-Request-Timeout / gRPC deadline)")
            event.clear()
            try:
                async with asyncio.timeout(min(left, self.recheck_s)):
                    await event.wait()
            except asyncio.TimeoutError:
                pass

    def _wake_head(self) -> None:
        head = self.queue.head()
        if head is not None and head.request_id in self._waiters:
            self._waiters[head.request_id].set()


class Passage:
    """One request past the gate: what its relay reports back."""

    def __init__(self, queue: GlobalQueue, req: SloRequest):
        self.queue, self.req = queue, req
        self.outcome = "cancelled"  # until the relay says otherwise

    def tokens(self, n: int) -> None:
        """``n`` tokens relayed now (a stream: the first ends the prefill, the rest time the decode)."""
        if n > 0:
            self.queue.token(self.req, n)

    def total(self, n: int) -> None:
        """A response that came whole: its length counts (output lengths), not its timing."""
        self.req.tokens = max(self.req.tokens, n)


def request_class(classes, body: bytes, header: str | None) -> tuple[SloClass, int]:
    """A body's SLO class (header / ``priority``) and its ``max_tokens`` (16, OpenAI's default, when
    absent or unreadable: the prefill validates the body). ValueError naming the known classes."""
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    doc = doc if isinstance(doc, dict) else {}
    max_tokens = doc.get("max_completion_tokens", doc.get("max_tokens"))
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        max_tokens = 16
    return classes.select(header, doc.get("priority")), max_tokens


def deadline_s(header: str | None, default_s: float) -> float:
    """How long the request may wait: the client's X-Request-Timeout when it is a positive number,
    capped by the router's --request-timeout (a malformed header is the prefill's 400 to give)."""
    try:
        value = float(header) if header is not None else default_s
    except ValueError:
        return default_s
    return min(value, default_s) if value > 0 and math.isfinite(value) else default_s


class TokenCounter:
    """Tokens of a relayed HTTP response, for the estimator: one SSE event per token as they pass
    (an event split over two chunks is counted once), or a whole response's usage at its end."""

    EVENT = b"data: {"

    def __init__(self, content_type: str, passage: Passage | None):
        self.passage = passage
        self.sse = content_type.startswith("text/event-stream")
        self._tail = b""
        self._body: list[bytes] = []

    def feed(self, chunk: bytes) -> None:
        if self.passage is None:
            return
        if not self.sse:
            self._body.append(chunk)
            return
        data = self._tail + chunk
        self.passage.tokens(data.count(self.EVENT))
        keep = len(self.EVENT) - 1
        self._tail = data[-keep:] if not data.endswith(self.EVENT) else b""

    def done(self) -> None:
        if self.passage is None or self.sse:
            return
        try:
            usage = json.loads(b"".join(self._body)).get("usage") or {}
            self.passage.total(int(usage.get("completion_tokens", 0)))
        except (ValueError, AttributeError, TypeError):
            pass
