"""RequestConductor: one request's way through this prefill, from its turn in line to its last Delta.

Request lifecycle (``RequestConductor.deltas``; ``PrefillNode.generate`` creates one conductor per
request, given the node's ``ConductorDeps`` (conductor_deps.py: the parts, the routing settings, the
hooks ``on_session_end`` and ``keep_timings``; never the node), and yields from it):

1. **admission turn** - ``Ticket.turn``: behind the requests already waiting in the
   ``AdmissionQueue`` (``admission_queue.py``), never ahead of them; at once when nobody waits.
2. **pick a decode** - the request must fit (this prefill's pool in all, the largest decode's
   pool in all: else ``RequestTooLarge`` at once; this prefill's free blocks now: else the round
   ends); then its prompt waits in our engine's line until the Scheduler wants it (``LinePlace``,
   engine_line.py: it holds nothing on any decode meanwhile, and keeps its place across the
   attempts, so a refusal never sends it to the back; a resume takes a new place for its longer
   prompt; none with ``--disaggregation never``); then, with the decodes' load of that moment, the
   DecodePicker's choice (with ``decode_reuse``, preferring a decode whose prefix
   cache holds the prompt's leading blocks, as its KV events in ``decode_index`` say, weighed
   against free memory), never a decode already tried this round.
3. **one attempt** - a Session with that decode (``SessionRunner.run``, decode_session.py), under
   a new session id per attempt (leftovers of a failed attempt, a cancel still travelling, never
   collide with it); once the decode allocated, the next request in line may go.
4. **outcome**:
   - *done* - the first Delta, then every Delta to the finish;
   - *retry another decode* - ``Retryable`` (refused, unreachable, failed before the first token):
     the next decode the picker picks, at most ``max_attempts`` decodes a round;
   - *resume* (``MidStreamResume``, mid_stream_resume.py) - ``DecodeFailed`` after tokens
     reached the client: prompt + the tokens produced go to the next decode, never one that
     failed the request and sent no load report since; when none can take it now, a wait in line
     for one, up to ``resume_wait_s``;
   - *wait in the queue* - local fallback off and every failure of the round "busy now" (decodes
     out of free blocks, or prefill's own pool full; a decode too small for the request is no
     reason not to wait for the others): ``Ticket.wait`` (woken by fresh load reports and by
     requests ending here), then a new round from 1., until the deadline (or ``queue_timeout_s``
     when set: then the 503). A full decode is a reason to wait, not to fail: a burst queues
     instead of failing;
   - *local fallback* (``LocalFallback``, local_fallback.py; ``local_fallback`` on) - no decode
     took it: this process's colocated engine decodes it (it never waits in line for a decode);
   - *give up* - ``NoDecodeAvailable`` listing every reason (or ``RequestTooLarge`` when every
     decode asked answered that it can never hold the request; ``QueueFull``, ``QueueTimeout``
     from the queue), or ``DecodeFailed`` for a request whose decode failed mid-stream (resume off,
     or no decode took it back).

With ``slo_queue`` (a ``pdserve.slo.GlobalQueue``) and the request's ``slo`` (its ``SloRequest``)
the line is in the order of the SLO policy (fifo | edf | qlm) and the queue learns when a decode
allocated the request.

Where the prompt is computed (``disaggregation``: auto|always|never): on this prefill with its KV
moved (the P/D path), or on the chosen decode itself; in ``auto`` the Disaggregator decides per
request from measured costs, after the decode's Allocation (decode_session.py).

Deadline: the request's end-to-end deadline (``time.monotonic()`` seconds) is enforced by the
caller (the Frontend cancels the generator when it passes); each Session carries it to its decode
as the gRPC deadline, so a decode frees the request by then even when this process cannot tell it
(frozen). A conductor cancelled while its request waits in line says so on the cancellation
(``admission_queue.note_waited_in_line``): the Frontend's deadline message names the queue.

A stream begun by another prefill (``produced``: the router resumes a stream whose prefill died,
``pdserve.stream_resume``) starts as a resume does (mid_stream_resume.py), after its tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncGenerator

from pdserve.cachestore.errors import CHECKSUM_MISMATCH
from pdserve.engine import blocks_needed, reusable_hashes

from .admission_queue import QueueTimeout, RequestTooLarge, note_waited_in_line
from .closing import aclose_fully
from .decode_session import DecodeFailed, Delta, NoDecodeAvailable, Retryable, SessionTimings, decode_reservation
from .engine_line import LinePlace
from .mid_stream_resume import MidStreamResume, resumed

if TYPE_CHECKING:
    from pdserve.engine import SamplingParams
    from pdserve.slo import SloRequest

    from .admission_queue import Ticket
    from .conductor_deps import ConductorDeps

log = logging.getLogger(__name__)

__all__ = ["RequestConductor", "TRANSIENT_CODES"]

# Refusals that mean "busy now": worth waiting in line for when nothing else works.
# busy now: wait in line and ask again ("tbt_bound": a decode's --tbt-slo-ms has no room for one more request now)
TRANSIENT_CODES = frozenset({"out_of_blocks", "prefill_busy", "tbt_bound"})


@dataclass(slots=True)
class _Round:
    """One pass over the decodes, between two turns in line (steps 2-4)."""

    silent: set[str]  # decodes that failed this request mid-stream, no load report since: not tried
    tried: set[str] = field(default_factory=set)
    transient: bool = True  # every failure this round was "busy now" (worth waiting for)
    too_large: bool = True  # every decode asked answered that the request can never fit there


class RequestConductor:
    """Conducts one request (module docstring): its state between the steps is these fields."""

    def __init__(self, deps: ConductorDeps, request_id: str, prompt_ids: list[int], sp: SamplingParams,
                 deadline: float | None = None, slo: SloRequest | None = None, produced: list[int] | tuple = ()):
        self.deps, self.request_id, self.prompt_ids, self.sp = deps, request_id, prompt_ids, sp
        self.deadline, self.slo = deadline, slo
        self.produced = list(produced)  # tokens the client already has (a resume goes on after them)
        self.reasons: list[str] = []  # why decodes did not take it, in order (the error's message)
        self.attempts = 0  # Sessions opened so far (each attempt is a new request for the decode)
        # what a decode reserves: prompt + max_tokens (tokens already produced move from one to the other)
        self.decode_need = decode_reservation(len(prompt_ids), sp.max_tokens, deps.block_size)
        self.resume = MidStreamResume(deps, request_id)
        self.round = _Round(set())
        self.admitted = time.monotonic()  # it arrived (for the queue-wait metric)
        self.ticket: Ticket = deps.queue.ticket(request_id, deadline, slo)
        self.place: LinePlace | None = None  # the prompt's place in our engine's line (step 2)
        self.places = 0  # places taken so far (each a new request id for the engine)

    async def deltas(self) -> AsyncGenerator[Delta, None]:
        """The request's Deltas (the lifecycle, module docstring); raises as ``PrefillNode.generate`` says."""
        try:
            while True:
                await self.ticket.turn()  # 1. behind the requests already waiting for blocks, never ahead of them
                self.round = _Round(silent=self.resume.silent())
                for _ in range(self.deps.max_attempts):
                    if not self._fits():  # 2.
                        break
                    place = await self._in_line()
                    address = self._pick()
                    if address is None:
                        break
                    stream, timings = self._open(address, place)  # 3.
                    try:
                        first = await self._first_delta(stream, timings)
                        if first is None:  # 4. retry another decode
                            continue
                        yield first  # 4. done
                        async for delta in stream:
                            self.produced += delta.token_ids
                            yield delta
                        return
                    except DecodeFailed as exc:  # 4. resume
                        if not self.deps.resume:
                            raise
                        self._failed_mid_stream(address, exc)
                        if len(self.produced) >= self.sp.max_tokens:
                            yield Delta([], True, "length")
                            return
                    finally:
                        await self._close(address, stream, timings)
                if not await self._next_round():  # 4. wait in the queue, or leave the decodes
                    break
        except asyncio.CancelledError as cancel:
            if self.ticket.queued:  # cancelled in line (its deadline, or the client): the Frontend says so
                note_waited_in_line(cancel, self.ticket.waited())
            raise
        finally:
            self.ticket.leave()
            if self.place is not None and not self.place.granted:  # a granted one is its run's (released there)
                self.place.leave()
        if self.deps.fallback is None:
            raise self._give_up()  # 4. give up
        async with aclosing(self.deps.fallback.deltas(self.request_id, self.prompt_ids, self.produced, self.sp,
                                                 self.reasons, self.resume.failure is not None)) as local:
            async for delta in local:  # 4. local fallback
                yield delta

    async def _in_line(self) -> LinePlace | None:
        """Step 2's wait: the prompt's place in our engine's line (the one it has while still waiting there, else a
        new one), once the Scheduler wants it; None when our engine never computes it."""
        runner, prompt = self.deps.session_runner, self.prompt_ids + self.produced
        sp_now = resumed(self.sp, len(self.produced))
        if not runner.needs_line(sp_now):
            return None
        if self.place is None or not self.place.waiting or self.place.num_tokens != len(prompt):
            if self.place is not None and not self.place.granted:
                self.place.leave()
            engine_id = self.request_id if self.places == 0 else f"{self.request_id}.line{self.places}"
            self.places += 1
            self.place = runner.line.enter(engine_id, prompt, sp_now)
        await self.place.wanted()
        return self.place

    def _pick(self) -> str | None:
        """Step 2: the decode for the next attempt; None ends the round (its reasons noted)."""
        overlap, prompt_blocks = self._decode_overlap(self.prompt_ids + self.produced)
        picker, r = self.deps.picker, self.round
        address = picker.pick(exclude=r.tried | r.silent, blocks_needed=self.decode_need, overlap=overlap,
                              prompt_blocks=prompt_blocks)
        if address is None:
            if not r.tried or self.resume.waits_for_a_decode():  # resuming: why no other decode
                self._note_once(self.resume.not_retrying(r.tried | r.silent, picker.why_none(self.decode_need)))
            if not r.tried:
                r.transient = picker.all_full(self.decode_need)
                r.too_large = False
            return None
        r.tried.add(address)
        if self.deps.metrics is not None:
            self.deps.metrics.decode_selections.labels(decode=address).inc()
        return address

    def _fits(self) -> bool:
        """Whether the request fits this prefill's free blocks now and some decode's pool; RequestTooLarge
        when it never can (a resumed one waits instead: the decode that failed held it; it may come back)."""
        deps = self.deps
        need = blocks_needed(len(self.prompt_ids) + len(self.produced), deps.block_size)
        if need > deps.engine.num_blocks:
            raise RequestTooLarge(f"the prompt needs {need} KV blocks but this prefill has only "
                                  f"{deps.engine.num_blocks} in all")
        largest = deps.picker.never_fits(self.decode_need)
        if largest is not None and deps.fallback is None:
            too_big = (f"the request needs {self.decode_need} KV blocks on a decode ({len(self.prompt_ids)} prompt "
                       f"tokens + max_tokens {self.sp.max_tokens}) but the largest decode holds only {largest} "
                       f"KV blocks in all")
            if self.resume.failure is None:
                raise RequestTooLarge(too_big)
            self._note_once(too_big)
            return False
        free = deps.engine.num_free_blocks()
        if need > free:
            self.reasons.append(f"prefill has {free} free KV blocks, {need} needed")
            self.round.too_large = False
            return False
        return True

    def _open(self, address: str, place: LinePlace | None):
        """Step 3: the attempt's Session with ``address`` (not started yet) and its timings."""
        timings = SessionTimings(arrived=self.admitted)
        sp_now = resumed(self.sp, len(self.produced))
        session_id = self.request_id if self.attempts == 0 else f"{self.request_id}.{self.attempts}"
        self.attempts += 1
        # once a decode allocated, the next request in line may go (the picker counts this one)
        stream = self.deps.session_runner.run(address, session_id, self.prompt_ids + self.produced, sp_now, timings,
                                              self.deadline, on_allocated=self.ticket.admitted,
                                              slo_class=self.slo.cls if self.slo is not None else None,
                                              place=place)
        return stream, timings

    async def _first_delta(self, stream, timings: SessionTimings) -> Delta | None:
        """The attempt's first Delta (the request has started), or None when the decode did not take it."""
        try:
            first = await stream.__anext__()
        except Retryable as exc:
            self._refused(exc)
            return None
        self.ticket.started()  # a later wait (a resume) is a new one
        self.deps.keep_timings(self.request_id, timings)
        m = self.deps.metrics
        if m is not None and not self.produced:  # admitted -> a decode allocated and compute starts
            m.queue_wait.observe(max(0.0, timings.allocated - self.admitted))
        self.produced += first.token_ids
        return first

    def _refused(self, exc: Retryable) -> None:
        """Outcome "retry another decode": this one did not take the request (nothing reached the client)."""
        log.info("request %s: %s", self.request_id, exc.reason)
        self.reasons.append(exc.reason)
        # a decode too small for it is no reason not to wait for the others
        self.round.transient = self.round.transient and exc.code in TRANSIENT_CODES | {"too_large"}
        self.round.too_large = self.round.too_large and exc.code == "too_large"
        self._count_retry(exc.code)

    def _failed_mid_stream(self, address: str, exc: DecodeFailed) -> None:
        """Outcome "resume": the decode failed after tokens reached the client."""
        self.resume.failed(address, exc)
        self.round.transient = self.round.too_large = False
        self.reasons.append(str(exc))
        log.warning("request %s: %s; resuming after %d tokens", self.request_id, exc, len(self.produced))
        self._count_retry(exc.code)

    def _count_retry(self, code: str) -> None:
        m = self.deps.metrics
        if m is not None:
            m.decode_retries.labels(reason=code).inc()
            if code == CHECKSUM_MISMATCH:
                m.kv_checksum_mismatches.inc()

    async def _close(self, address: str, stream, timings: SessionTimings) -> None:
        """The attempt's end, whatever its outcome: its Session closed, its blocks there free."""
        await aclose_fully(stream)
        if timings.allocated:
            self.deps.on_session_end(address)

    async def _next_round(self) -> bool:
        """After a round that did not serve the request: whether another round comes (after a wait in
        line); False leaves the decodes (local fallback or give up)."""
        r = self.round
        if r.tried and r.too_large and self.deps.fallback is None and self.resume.failure is None:
            raise RequestTooLarge("no decode can ever hold the request: " + "; ".join(self.reasons[-len(r.tried):]))
        if self.deps.fallback is not None:
            return False
        if self.resume.failure is not None:  # resuming, and no decode can take it now: wait for one
            if not await self.resume.wait(self.ticket, self.reasons):
                return False
        elif not r.transient or not await self._wait_in_line():
            return False
        self.reasons = self.reasons[-4:]
        return True

    async def _wait_in_line(self) -> bool:
        """Outcome "wait in the queue": every decode (or prefill itself) is full right now; False when the
        wait ended by ``queue_timeout_s`` (its reason noted; the deadline's QueueTimeout is raised)."""
        try:
            await self.ticket.wait()
        except QueueTimeout as exc:
            if exc.by_deadline:
                raise
            self.reasons.append(str(exc))
            return False
        return True

    def _give_up(self) -> Exception:
        """Outcome "give up": the error for a request no decode served (no local fallback)."""
        if self.resume.failure is not None:
            return DecodeFailed(self.resume.gave_up or "; ".join(self.reasons))
        return NoDecodeAvailable("no decode server could take the request: " + "; ".join(self.reasons))

    def _note_once(self, reason: str) -> None:
        if reason not in self.reasons:  # the same picture on every queued retry: say it once
            self.reasons.append(reason)

    def _decode_overlap(self, ids: list[int]) -> tuple[dict[str, int], int]:
        """Leading blocks of ``ids`` each known decode holds (at most the reusable ones), and how many
        blocks a decode could reuse at most; ({}, 0) without decode reuse or an index."""
        index = self.deps.decode_index
        if index is None:
            return {}, 0
        hashes = reusable_hashes(ids, self.deps.block_size)
        if not hashes:
            return {}, 0
        return {address: index.overlap(address, hashes) for address in self.deps.picker.known()}, len(hashes)
