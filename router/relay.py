"""Relay: one request on its way through the prefills; the one owner of its ranking, its retries and its
in-flight counts, for the HTTP relay (``http_api.py``) and the gRPC one (``grpc_api.py``) alike, which only
speak their protocol.

Lifecycle of one relayed request: rank -> try prefill -> outcome: stream / retry next / resume after
death / give up.

1. **rank** - ``await relay.rank()``: ``Router.decide`` over the routable prefills (its time is the
   ``router_overhead`` metric); none routable: wait for one up to ``prefill_wait_s`` (and the request's
   deadline); still none: False, counted ``no_prefill`` (the door answers 503 / UNAVAILABLE).
   ``with relay:`` then counts the request in its front door's ``in_flight`` until its end.
2. **try prefill** - ``await relay.next_attempt()``: the next prefill of the ranking (at most
   ``max_attempts`` of each ranking), skipping one that is not routable, one that refused this request
   since its last load report and one that failed it; ``with attempt:`` counts it in flight on its
   PrefillWatch (the load ``Router.decide`` sees) while the door talks to it; ``attempt.count()`` records
   the decision (reason: the ranking's, ``retry`` or ``resume``): HTTP once the prefill answered other than
   a refusal, gRPC when the call is made (a call shows its acceptance only with its first response).
3. **outcome** of an attempt, as the door tells it:
   - **stream**: the prefill's answer goes to the client: ``relay.finish(outcome, reason)``;
   - **retry next**: nothing reached the client. Unreachable: just the next attempt (the prefill may come
     back in a later ranking); ``attempt.refused(answer)``: it has no decode for the request (not tried
     again before its next load report; its answer is kept, the one to give when all refuse);
     ``attempt.broke()``: it broke before its answer started (never tried again). When a ranking is used
     up and a prefill refused or broke, the relay waits (up to ``prefill_wait_s``) for another ranking;
   - **resume after death**: the prefill broke after part of a stream reached the client:
     ``attempt.broke()``, then ``relay.next_resume(sent)`` for each try: the best routable prefill that
     has not failed the request, for the prompt plus the tokens sent, waiting up to ``prefill_wait_s``
     (from the first resume) and never past the deadline; None once none can (``gave_up`` says why).
     ``attempt.broke(why)`` on a failed resume keeps the why; ``relay.resumed(why_not)`` counts the
     outcome (``router_resumes``) and finishes the request (``ok/resumed`` or ``error/prefill_failed``);
   - **give up**: ``next_attempt()`` is None: the door answers with ``refusal`` (the last refusing
     prefill's own answer), else why (``tried``, ``failed``).
4. **release** - the end of ``with relay:`` (the answer, a give-up, or the client leaving: the door's
   handler is cancelled): the door's in-flight count, ``e2e_latency`` and ``requests{outcome, reason}``,
   once (``cancelled/client_disconnected`` unless ``finish`` said otherwise); with the SLO queue, the
   passage's outcome is the request's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.defaults import PREFILL_WAIT_S

from .choice import Choice
from .router import refusing

if TYPE_CHECKING:
    from .prefill_watch import PrefillWatch

MIN_LEFT_S = 0.001  # a request with less time left than this is past its deadline (timeouts go in milliseconds)


class Relays:
    """What the router's front doors share to relay: the Router, the metrics, the retry settings, and the
    requests each door (``http``, ``grpc``) relays now."""

    def __init__(self, router, metrics, max_attempts: int = 2, prefill_wait_s: float = PREFILL_WAIT_S):
        self.router, self.metrics = router, metrics
        self.max_attempts = max_attempts  # prefills tried per ranking
        self.prefill_wait_s = prefill_wait_s  # how long a request waits for a prefill that can take it
        self.in_flight: dict[str, int] = {"http": 0, "grpc": 0}

    def open(self, door: str, ids: list[int] | None, timeout_s: float | None, passage=None) -> Relay:
        """A request of ``door`` for the prompt ``ids`` (None: unknown, routed by load), with ``timeout_s``
        left (None: no deadline) and its SLO ``passage`` (or None)."""
        return Relay(self, door, ids, timeout_s, passage)


class Relay:
    def __init__(self, relays: Relays, door: str, ids: list[int] | None, timeout_s: float | None, passage=None):
        self.relays, self.router, self.metrics = relays, relays.router, relays.metrics
        self.door, self.ids, self.passage = door, ids, passage
        self.start = time.perf_counter()
        now = time.monotonic()
        self.deadline = math.inf if timeout_s is None else now + timeout_s
        self.wait_until = now + min(relays.prefill_wait_s, math.inf if timeout_s is None else timeout_s)
        self.choice: Choice | None = None  # the ranking being tried
        self.tried: list[str] = []
        self.failed: set[str] = set()  # prefills that broke on this request (never tried again)
        self.refused: dict[str, float] = {}  # prefill -> when it answered that it has no decode for the request
        self.refusal = None  # the last such answer, as the door keeps it
        self.reasons: list[str] = []  # why resumes failed
        self.gave_up: str | None = None  # why the stream could not be resumed
        self.outcome, self.reason = "cancelled", "client_disconnected"
        self._left: list[str] = []  # the ranking's prefills not tried yet
        self._k = 0  # position in the ranking of the next one
        self._replied = False
        self._resume_until: float | None = None

    # ---- 1. rank --------------------------------------------------------------------------------------
    async def rank(self) -> bool:
        self.choice = self.router.decide(self.ids)
        self.metrics.router_overhead.observe(time.perf_counter() - self.start)
        if self.choice is None:
            self.choice = await self.router.decide_waiting(self.ids, self.wait_until)
        if self.choice is None:
            self.metrics.requests.labels(outcome="error", reason="no_prefill").inc()
            return False
        self._plan()
        return True

    def _plan(self) -> None:
        ranking = () if self.choice is None else self.choice.ranking
        self._left, self._k = [a for a in ranking if a not in self.failed][: self.relays.max_attempts], 0

    # ---- 2. try prefill ---------------------------------------------------------------------------------
    async def next_attempt(self) -> Attempt | None:
        """The next prefill to try; None: give up."""
        while self.choice is not None:
            while self._left:
                address, k = self._left.pop(0), self._k
                self._k += 1
                watch = self.router.prefills.watches.get(address)
                if watch is None or not watch.routable() or refusing(watch, self.refused):
                    continue
                why = self.choice.reason if k == 0 and not self.refused and not self.failed else "retry"
                self.tried.append(address)
                return Attempt(self, address, watch, why, self.choice, self.ids)
            # every prefill of the ranking tried: one refused for want of a decode, or broke before its answer
            # started: wait (bounded) for one that can take the request
            self.choice = (await self.router.decide_waiting(self.ids, self.wait_until, self.refused,
                                                            exclude=self.failed)
                           if self.refused or self.failed else None)
            self._plan()
        return None

    def replied(self) -> None:
        """The first of the answer reached the client (TTFT at the router)."""
        if not self._replied:
            self._replied = True
            self.metrics.ttft.observe(time.perf_counter() - self.start)

    # ---- 3. resume after death ----------------------------------------------------------------------------
    async def next_resume(self, sent: list[int]) -> Attempt | None:
        """The prefill to continue the stream on after the ``sent`` tokens; None: give up (``gave_up``)."""
        if self._resume_until is None:
            self._resume_until = min(time.monotonic() + self.relays.prefill_wait_s, self.deadline)
        key = None if self.ids is None else self.ids + sent
        while True:
            choice = self.router.decide(key)
            address = next((a for a in (choice.ranking if choice is not None else ())
                            if a not in self.failed and self._routable(a)), None)
            if address is not None:
                break
            if await self.router.decide_waiting(key, self._resume_until, exclude=self.failed) is None:
                self.gave_up = "; ".join(self.reasons[-4:]) or "no other prefill is routable"
                return None
        left = self.deadline - time.monotonic()
        if left < MIN_LEFT_S:
            self.gave_up = "; ".join(self.reasons[-4:] + ["the request's deadline passed"])
            return None
        return Attempt(self, address, self.router.prefills.watches[address], "resume", choice, key, left)

    def _routable(self, address: str) -> bool:
        watch = self.router.prefills.watches.get(address)
        return watch is not None and watch.routable()

    def resumed(self, why_not: str | None, resumable: bool = True) -> None:
        """The end of a stream whose prefill broke: continued (``why_not`` None) or not."""
        if resumable:
            self.metrics.router_resumes.labels(outcome="resumed" if why_not is None else "failed").inc()
        self.finish(*(("ok", "resumed") if why_not is None else ("error", "prefill_failed")))

    # ---- 4. release --------------------------------------------------------------------------------------
    def finish(self, outcome: str, reason: str) -> None:
        self.outcome, self.reason = outcome, reason
        if self.passage is not None:
            self.passage.outcome = outcome

    def tried_text(self) -> str:
        return ", ".join(self.tried) or "none routable"

    def __enter__(self) -> Relay:
        self.relays.in_flight[self.door] += 1
        return self

    def __exit__(self, *exc) -> None:
        self.relays.in_flight[self.door] -= 1
        self.metrics.e2e_latency.observe(time.perf_counter() - self.start)
        self.metrics.requests.labels(outcome=self.outcome, reason=self.reason).inc()


@dataclass(eq=False)
class Attempt:
    """One prefill tried for a relay (step 2), or to continue its stream (step 3)."""

    relay: Relay
    address: str
    watch: PrefillWatch
    why: str  # the decision's reason label: the ranking's, retry or resume
    choice: Choice
    key: list[int] | None  # the prompt it is routed by (a resume's: with the tokens sent)
    time_left: float = math.inf  # a resume's: seconds left to the request's deadline

    def __enter__(self) -> Attempt:
        self.watch.in_flight += 1
        return self

    def __exit__(self, *exc) -> None:
        self.watch.in_flight -= 1

    def count(self) -> None:
        self.relay.router.count_decision(self.address, self.why, self.choice, self.key)

    def refused(self, answer) -> None:
        self.relay.refused[self.address], self.relay.refusal = time.monotonic(), answer

    def broke(self, why: str | None = None) -> None:
        self.relay.failed.add(self.address)
        if why is not None:
            self.relay.reasons.append(why)
