"""MidStreamResume: the policy when a decode fails a request after tokens reached the client.

Resume (``ConductorDeps.resume``, the default; the ``RequestConductor``'s outcome "resume",
conductor.py): when a decode fails mid-generation, the request continues on the next decode (or
locally) by prefilling prompt + the tokens generated so far, with max_tokens reduced by those tokens
(``resumed``); the client's stream just goes on. Greedy requests give exactly the tokens they would
have, and so do seeded ones (their draws go on at the resume point's position:
``SamplingParams.seed_position``). A grammar (response_format) is rebuilt on the next decode by
accepting the produced tokens first (its ``feed``), so the output stays valid across the resume.

1. The next decode is tried at once (never the one that failed, in the same round).
2. When none can take the request now (every other one full or refusing, or none has reported yet:
   a decode that just started is not known before its first load report), it waits for one, as a
   full decode is a reason to wait, not to fail: back in the admission queue at its arrival position
   (``admission_queue.py``, "Re-entry": woken by fresh load reports, fair to the requests already
   waiting) for at most ``resume_wait_s`` (``--resume-wait``, counted from the failure) and never
   past its deadline (``wait``).
3. Then, with no local fallback, the client gets ``DecodeFailed`` naming the failure, the wait and
   why no decode took it (``gave_up``; 0: at once, without a wait).

After a wait the failed decode may be tried again once a load report from it arrived after the
failure (a transient failure); a dead or frozen one sends none (``silent``). Without resume the
``DecodeFailed`` reaches the client at once.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from .admission_queue import QueueFull, QueueTimeout
from .decode_session import DecodeFailed

if TYPE_CHECKING:
    from pdserve.engine import SamplingParams

    from .admission_queue import Ticket
    from .conductor_deps import ConductorDeps

log = logging.getLogger(__name__)

__all__ = ["MidStreamResume", "resumed"]


class MidStreamResume:
    """One request's resume policy (module docstring): which decodes not to try again yet, how long
    to wait in line for another, and the message when none came."""

    def __init__(self, deps: ConductorDeps, request_id: str):
        self.deps, self.request_id = deps, request_id
        self.failure: DecodeFailed | None = None  # the latest failure (set: the request is resuming)
        self.failed_at: dict[str, float] = {}  # decode -> when it failed mid-stream (picker's clock), for silent
        self.until: float | None = None  # the end of the wait for a decode after the latest failure (queue's clock)
        self.announced: float | None = None  # the wait already logged
        self.gave_up = ""  # why the wait for a decode to resume on ended without one

    def failed(self, address: str, exc: DecodeFailed) -> None:
        """``address`` failed the request mid-stream now: the wait for another decode counts from here."""
        self.failure = exc
        self.failed_at[address] = self.deps.picker.clock()
        self.until = self.deps.queue.clock() + self.deps.resume_wait_s

    def waits_for_a_decode(self) -> bool:
        """A decode failed this request and the policy waits for another (so says why none took it)."""
        return bool(self.failed_at) and self.deps.resume_wait_s > 0

    def silent(self) -> set[str]:
        """The decodes that failed this request mid-stream and sent no load report since (dead or
        frozen, it may be): not tried again until one arrives."""
        silent = set()
        for address, when in self.failed_at.items():
            reported = self.deps.picker.reported_at(address)
            if reported is None or reported <= when:
                silent.add(address)
        return silent

    def not_retrying(self, excluded: set[str], reason: str) -> str:
        """The picker's ``reason`` for no decode, naming the excluded decodes that failed this request."""
        failed = sorted(excluded & self.failed_at.keys())
        if failed:
            return f"not retrying {', '.join(failed)} (failed mid-generation, no load report since); {reason}"
        return reason

    async def wait(self, ticket: Ticket, reasons: list[str]) -> bool:
        """Wait in line for a decode until ``until`` (never past the deadline); False when there is no
        wait (``resume_wait_s`` 0) or it ended without one (``gave_up`` says why)."""
        wait_s, until = self.deps.resume_wait_s, self.until
        if not wait_s > 0 or until is None:  # (until: set by ``failed``)
            return False
        if self.announced != self.until:
            self.announced = self.until
            log.info("request %s: no decode can take it now; waiting up to %gs for one (--resume-wait)",
                     self.request_id, wait_s)
        try:
            await ticket.wait(until=self.until)
        except (QueueTimeout, QueueFull) as exc:
            waited = self.deps.queue.clock() - (until - wait_s)
            self.gave_up = self._gave_up(reasons, waited, exc)
            return False
        return True

    def _gave_up(self, reasons: list[str], waited: float, exc: QueueTimeout | QueueFull) -> str:
        """The DecodeFailed message when no decode took a resumed request in time: the failure, the
        wait and what ended it, and why no decode could take it (the reasons since the failure, each once)."""
        failure = self.failure
        after = reasons[len(reasons) - reasons[::-1].index(str(failure)):] if str(failure) in reasons else reasons
        why = "; ".join(list(dict.fromkeys(after))[-4:]) or "no other decode known"
        if isinstance(exc, QueueFull):
            return f"{failure}; no decode could take the request to resume it ({why}) and it cannot wait: {exc}"
        limit = "until the request's deadline" if exc.by_deadline else f"(--resume-wait {self.deps.resume_wait_s:g}s)"
        return f"{failure}; no decode could take the request to resume it: waited {waited:.1f}s for one {limit}: {why}"


def resumed(sp: SamplingParams, produced: int) -> SamplingParams:
    """The SamplingParams for a request resumed after ``produced`` tokens (sent as part of the prompt):
    max_tokens reduced by them, a grammar told to accept them first (its state at the resume point), the
    seeded draws going on at their position, and no prompt logprobs (the client got them with its first
    tokens)."""
    if not produced:
        return sp
    grammar = sp.grammar if sp.grammar is None else replace(sp.grammar, feed=sp.grammar.feed + produced)
    return replace(sp, max_tokens=sp.max_tokens - produced, grammar=grammar, prompt_logprobs=None,
                   seed_position=sp.seed_position + produced)
