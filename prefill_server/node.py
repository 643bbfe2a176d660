"""PrefillNode: everything one prefill process owns, and the routing of one request.

``generate(request_id, prompt_ids, sampling)`` is the single entry the HTTP and gRPC
front ends call. It yields ``Delta``s and raises:

- ``NoDecodeAvailable`` (-> HTTP 503 / gRPC UNAVAILABLE) when no decode took the request
  after ``max_attempts`` tries and local fallback is off; the message lists every reason;
  its kinds ``RequestTooLarge`` (-> 413 / INVALID_ARGUMENT: more KV blocks than any decode,
  or this prefill, holds in all; never a wait) and ``QueueFull`` (-> 429 /
  RESOURCE_EXHAUSTED: ``max_queued`` requests already wait);
- ``QueueTimeout`` when the request's deadline came while it waited in line (-> 504);
- ``DecodeFailed`` when a decode failed after tokens reached the client and the request
  could not be resumed (no other decode took it within ``resume_wait_s``).

Routing order: the DecodePicker's choice (with ``decode_reuse``, preferring a decode whose
prefix cache holds the prompt's leading blocks, as its KV events in ``decode_index`` say,
weighed against free memory); on refusal / unreachable / failure before the
first token, the next decode it picks (never one already tried), at most
``max_attempts`` decodes; then, with ``local_fallback``, the colocated engine in this
process; else NoDecodeAvailable. When every failure was "busy now" (decodes out of free
blocks, or prefill's own pool full) and local fallback is off, the request waits in the
``AdmissionQueue`` (``admission_queue.py``: first come first served, woken by fresh load
reports and by requests ending here) and tries again when its turn comes, until its
deadline (or ``queue_timeout_s`` when set: then the 503). A full decode is a reason to
wait, not to fail: a burst queues instead of failing. With ``slo_queue`` (a
``pdserve.slo.GlobalQueue``) and the request's ``slo`` (its ``SloRequest``) the line is in
the order of the SLO policy (fifo | edf | qlm) and the queue learns when a decode allocated
the request.

Where the prompt is computed (``disaggregation``: auto|always|never): on this prefill with
its KV moved (the P/D path), or on the chosen decode itself; in ``auto`` the Disaggregator
decides per request from measured costs, after the decode's Allocation (decode_session.py).

Deadline: ``generate(..., deadline=...)`` (``time.monotonic()`` seconds) is the request's
end-to-end deadline, enforced by the caller (the Frontend cancels this generator when it
passes); each Session carries it to its decode as the gRPC deadline, so a decode frees the
request by then even when this process cannot tell it (frozen).

Resume (``resume=True``, the default): when a decode fails mid-generation, the request
continues on the next decode (or locally) by prefilling prompt + the tokens generated so
far, with max_tokens reduced by those tokens; the client's stream just goes on. Greedy
requests give exactly the tokens they would have, and so do seeded ones (their draws go on
at the resume point's position: ``SamplingParams.seed_position``). A grammar (response_format)
is rebuilt on the next decode by accepting the produced tokens first (``resumed``: its
``feed``), so the output stays valid across the resume. The next decode is tried at once (never the one that failed, in the same round).
When none can take the request now (every other one full or refusing, or none has reported
yet: a decode that just started is not known before its first load report), it waits for
one, as a full decode is a reason to wait, not to fail: back in the admission queue at its
arrival position (``admission_queue.py``, "Re-entry": woken by fresh load reports, fair to
the requests already waiting) for at most ``resume_wait_s`` (``--resume-wait``, counted
from the failure) and never past its deadline; then, with no local fallback, the client
gets ``DecodeFailed`` naming the failure, the wait and why no decode took it (0: at once,
without a wait). After a wait the failed decode may be tried again once a load report
from it arrived after the failure (a transient failure); a dead or frozen one sends none.

A stream begun by another prefill (``generate(..., produced=...)``: the router resumes a stream
whose prefill died, ``pdserve.stream_resume``) starts as such a resume does, after its tokens.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

from pdserve import defaults
from pdserve.cachestore.errors import CHECKSUM_MISMATCH
from pdserve.defaults import DISAGGREGATION
from pdserve.engine import blocks_needed, reusable_hashes
from pdserve.protos import session_pb2 as pb

from .admission_queue import AdmissionQueue, QueueFull, QueueTimeout, RequestTooLarge
from .closing import aclose_fully
from .decode_index import DecodeIndex
from .decode_session import (DecodeFailed, Delta, NoDecodeAvailable, Retryable, SessionConfig, SessionRunner,
                             SessionTimings, decode_reservation)
from .disaggregator import Disaggregator
from .load_poller import LoadReportPoller
from .picker import DecodePicker
from .transfer_accounting import TransferAccounting

if TYPE_CHECKING:
    from pdserve.cachestore import CacheStoreSender
    from pdserve.engine import AsyncLLMEngine
    from pdserve.metrics import ServerMetrics
    from pdserve.slo import GlobalQueue, SloRequest

log = logging.getLogger(__name__)

__all__ = ["PrefillNode", "NoDecodeAvailable", "DecodeFailed", "Delta", "QueueFull", "QueueTimeout", "RequestTooLarge"]

# Refusals that mean "busy now": worth waiting in line for when nothing else works.
TRANSIENT_CODES = frozenset({"out_of_blocks", "prefill_busy"})


@dataclass
class PrefillNode:
    engine: AsyncLLMEngine  # prefill_only / release / generate; num_blocks, num_free_blocks() from the loop
    sender: CacheStoreSender
    picker: DecodePicker
    poller: LoadReportPoller
    compat: pb.Compat
    block_size: int
    kv_bytes_per_block: int  # all layers, K and V
    eos_token_ids: tuple[int, ...] = ()
    max_attempts: int = 3
    local_fallback: bool = False
    session_timeout_s: float = defaults.SESSION_TIMEOUT_S
    connect_timeout_s: float = 5.0
    metrics: ServerMetrics | None = None
    out_of_blocks_error: type[Exception] = RuntimeError  # the engine's OutOfBlocksError
    resume: bool = True  # continue on another decode when one fails mid-generation
    queue_timeout_s: float | None = None  # how long a request may wait in line for KV blocks (None: until its deadline)
    resume_wait_s: float = defaults.RESUME_WAIT_S  # after a mid-stream failure, how long to wait for a decode (0: fail)
    max_queued: int = defaults.MAX_QUEUED_REQUESTS  # requests that may wait in line at once; then 429
    layerwise_push: bool = True  # push each layer as it is written (False: all layers after the forward pass)
    prefills_ahead: int = 2  # Sessions allocated on a decode before our engine computed their prompt (SessionConfig)
    decode_reuse: bool = True  # decodes serve the prompt's cached prefix; only the missing blocks move
    decode_index: DecodeIndex | None = None  # the decodes' prefix caches (their KV events), for the picker
    disaggregation: str = DISAGGREGATION  # auto | always | never (cost_model.py)
    held_prefix: Callable[[list[int]], int] | None = None  # prompt hashes -> leading ones our prefix cache holds
    slo_queue: GlobalQueue | None = None  # SLO classes: the policy that orders the admission queue

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not self.resume_wait_s >= 0:
            raise ValueError(f"resume_wait_s must be >= 0, got {self.resume_wait_s}")
        self.sessions: dict[str, str] = {}  # request id -> decode address, while a Session is open
        self.local_requests = 0
        self.last_timings: dict[str, SessionTimings] = {}
        config = SessionConfig(self.compat, self.block_size, self.eos_token_ids, self.session_timeout_s,
                               self.connect_timeout_s, self.layerwise_push, self.out_of_blocks_error, self.decode_reuse,
                               self.prefills_ahead)
        self.disaggregator = Disaggregator(self.disaggregation, picker=self.picker, block_size=self.block_size,
                                           num_layers=self.compat.num_layers, kv_bytes_per_block=self.kv_bytes_per_block,
                                           layerwise=self.layerwise_push, held_prefix=self.held_prefix,
                                           metrics=self.metrics)
        accounting = TransferAccounting(self.picker, self.kv_bytes_per_block, self.disaggregator, self.metrics)
        self.session_runner = SessionRunner(config, stubs=self.poller.stub, engine=self.engine, sender=self.sender,
                                            registry=self.sessions, observer=accounting,
                                            disaggregator=self.disaggregator)
        gauge = self.metrics.requests_queued.set if self.metrics is not None else None
        self.left_while_queued: dict[str, float] = {}  # request id -> seconds it had waited (Frontend pops it)
        self.queue = AdmissionQueue(self.max_queued, max_wait_s=self.queue_timeout_s, on_length=gauge,
                                    slo=self.slo_queue)
        self.poller.on_report = lambda address: self.queue.notify()  # a fresh report may show freed blocks

    def ready(self) -> bool:
        """Ready when a decode is known (or local fallback can serve); a decode that is full now
        still counts: its requests wait in the admission queue (a full pool must not make the
        prefill unready, or routers and Services would send nothing to it: 503s, not waits)."""
        return self.local_fallback or bool(self.picker.usable())

    async def generate(self, request_id: str, prompt_ids: list[int], sp, deadline: float | None = None,
                       slo: SloRequest | None = None, produced: list[int] | tuple = ()):
        """``produced``: tokens the client already has (fewer than ``sp.max_tokens``), from a stream another
        prefill began (``pdserve.stream_resume``): the request goes on after them as after a decode's failure."""
        reasons: list[str] = []
        produced = list(produced)  # tokens already given to the client (for resume)
        failed_mid_stream: DecodeFailed | None = None
        failed_at: dict[str, float] = {}  # decode -> when it failed mid-stream (picker's clock), for _silent
        resume_until: float | None = None  # the end of the wait for a decode after the latest failure (queue's clock)
        gave_up = ""  # why the wait for a decode to resume on ended without one
        announced: float | None = None  # the resume wait already logged
        m = self.metrics
        admitted = time.monotonic()
        ticket = self.queue.ticket(request_id, deadline, slo)
        attempt = 0
        try:
            while True:
                await ticket.turn()  # behind the requests already waiting for blocks, never ahead of them
                tried: set[str] = set()
                silent = self._silent(failed_at)  # failed this request mid-stream, no load report since
                transient = True  # every failure this round was "busy now" (worth waiting for)
                too_large = True  # every decode asked answered that the request can never fit there
                for _ in range(self.max_attempts):
                    need = blocks_needed(len(prompt_ids) + len(produced), self.block_size)
                    if need > self.engine.num_blocks:
                        raise RequestTooLarge(f"the prompt needs {need} KV blocks but this prefill has only "
                                              f"{self.engine.num_blocks} in all")
                    # what decode reserves: prompt + max_tokens (tokens already produced move from one to the other)
                    decode_need = decode_reservation(len(prompt_ids), sp.max_tokens, self.block_size)
                    largest = self.picker.never_fits(decode_need)
                    if largest is not None and not self.local_fallback:
                        too_big = (f"the request needs {decode_need} KV blocks on a decode ({len(prompt_ids)} prompt "
                                   f"tokens + max_tokens {sp.max_tokens}) but the largest decode holds only {largest} "
                                   f"KV blocks in all")
                        if failed_mid_stream is None:
                            raise RequestTooLarge(too_big)
                        if too_big not in reasons:  # resuming: the decode that failed held it; it may come back
                            reasons.append(too_big)
                        break
                    free = self.engine.num_free_blocks()
                    if need > free:
                        reasons.append(f"prefill has {free} free KV blocks, {need} needed")
                        too_large = False
                        break
                    overlap, prompt_blocks = self._decode_overlap(prompt_ids + produced)
                    address = self.picker.pick(exclude=tried | silent, blocks_needed=decode_need, overlap=overlap,
                                               prompt_blocks=prompt_blocks)
                    if address is None:
                        if not tried or (failed_at and self.resume_wait_s > 0):  # resuming: why no other decode
                            reason = self.picker.why_none(decode_need)
                            failed = sorted((tried | silent) & failed_at.keys())
                            if failed:
                                reason = (f"not retrying {', '.join(failed)} (failed mid-generation, no load report "
                                          f"since); {reason}")
                            if reason not in reasons:  # the same picture on every queued retry: say it once
                                reasons.append(reason)
                        if not tried:
                            transient = self.picker.all_full(decode_need)
                            too_large = False
                        break
                    tried.add(address)
                    if m is not None:
                        m.decode_selections.labels(decode=address).inc()
                    timings = SessionTimings()
                    sp_now = resumed(sp, len(produced))
                    # each attempt is a new request for the decode, the CacheStore and our engine:
                    # leftovers of a failed attempt (a cancel still travelling) never collide with it
                    session_id = request_id if attempt == 0 else f"{request_id}.{attempt}"
                    attempt += 1
                    # once a decode allocated, the next request in line may go (the picker counts this one)
                    stream = self.session_runner.run(address, session_id, prompt_ids + produced, sp_now, timings, deadline,
                                                     on_allocated=ticket.admitted,
                                                     slo_class=slo.cls if slo is not None else None)
                    try:
                        try:
                            first = await stream.__anext__()
                        except Retryable as exc:
                            log.info("request %s: %s", request_id, exc.reason)
                            reasons.append(exc.reason)
                            # a decode too small for it is no reason not to wait for the others
                            transient = transient and exc.code in TRANSIENT_CODES | {"too_large"}
                            too_large = too_large and exc.code == "too_large"
                            if m is not None:
                                m.decode_retries.labels(reason=exc.code).inc()
                                if exc.code == CHECKSUM_MISMATCH:
                                    m.kv_checksum_mismatches.inc()
                            continue
                        ticket.started()  # a later wait (a resume) is a new one
                        self._keep_timings(request_id, timings)
                        if m is not None and not produced:  # admitted -> a decode allocated and compute starts
                            m.queue_wait.observe(max(0.0, timings.allocated - admitted))
                        produced += first.token_ids
                        yield first
                        async for delta in stream:
                            produced += delta.token_ids
                            yield delta
                        return
                    except DecodeFailed as exc:
                        if not self.resume:
                            raise
                        failed_mid_stream = exc
                        failed_at[address] = self.picker.clock()
                        resume_until = self.queue.clock() + self.resume_wait_s
                        transient = too_large = False
                        reasons.append(str(exc))
                        log.warning("request %s: %s; resuming after %d tokens", request_id, exc, len(produced))
                        if m is not None:
                            m.decode_retries.labels(reason=exc.code).inc()
                            if exc.code == CHECKSUM_MISMATCH:
                                m.kv_checksum_mismatches.inc()
                        if len(produced) >= sp.max_tokens:
                            yield Delta([], True, "length")
                            return
                    finally:
                        await aclose_fully(stream)
                        if timings.allocated:
                            self._freed(address)
                if tried and too_large and not self.local_fallback and failed_mid_stream is None:
                    raise RequestTooLarge("no decode can ever hold the request: " + "; ".join(reasons[-len(tried):]))
                if self.local_fallback:
                    break
                if failed_mid_stream is not None:  # resuming, and no decode can take it now: wait for one (module doc)
                    if not self.resume_wait_s > 0:
                        break
                    if announced != resume_until:
                        announced = resume_until
                        log.info("request %s: no decode can take it now; waiting up to %gs for one (--resume-wait)",
                                 request_id, self.resume_wait_s)
                    try:
                        await ticket.wait(until=resume_until)
                    except (QueueTimeout, QueueFull) as exc:
                        waited = self.queue.clock() - (resume_until - self.resume_wait_s)
                        gave_up = self._gave_up(failed_mid_stream, reasons, waited, exc)
                        break
                    reasons = reasons[-4:]
                    continue
                if not transient:
                    break
                # every decode (or prefill itself) is full right now: wait in line for blocks to free up
                try:
                    await ticket.wait()
                except QueueTimeout as exc:
                    if exc.by_deadline:
                        raise
                    reasons.append(str(exc))
                    break
                reasons = reasons[-4:]
        finally:
            if ticket.queued:  # still in line (its deadline, or the client, cancelled it): the Frontend says so
                self.left_while_queued[request_id] = ticket.waited()
            ticket.leave()
        if self.local_fallback:
            async for delta in self._generate_locally(request_id, prompt_ids, produced, sp, reasons, failed_mid_stream):
                yield delta
            return
        if failed_mid_stream is not None:
            raise DecodeFailed(gave_up or "; ".join(reasons))
        raise NoDecodeAvailable("no decode server could take the request: " + "; ".join(reasons))

    def _silent(self, failed_at: dict[str, float]) -> set[str]:
        """The decodes that failed this request mid-stream and sent no load report since (dead or
        frozen, it may be): not tried again until one arrives."""
        silent = set()
        for address, when in failed_at.items():
            reported = self.picker.reported_at(address)
            if reported is None or reported <= when:
                silent.add(address)
        return silent

    def _gave_up(self, failure: DecodeFailed, reasons: list[str], waited: float, exc: Exception) -> str:
        """The DecodeFailed message when no decode took a resumed request in time: the failure, the
        wait and what ended it, and why no decode could take it (the reasons since the failure, each once)."""
        after = reasons[len(reasons) - reasons[::-1].index(str(failure)):] if str(failure) in reasons else reasons
        why = "; ".join(list(dict.fromkeys(after))[-4:]) or "no other decode known"
        if isinstance(exc, QueueFull):
            return f"{failure}; no decode could take the request to resume it ({why}) and it cannot wait: {exc}"
        limit = "until the request's deadline" if exc.by_deadline else f"(--resume-wait {self.resume_wait_s:g}s)"
        return f"{failure}; no decode could take the request to resume it: waited {waited:.1f}s for one {limit}: {why}"

    def _freed(self, address: str) -> None:
        """A request's Session with ``address`` ended: its blocks there are free. With requests in
        line, ask that decode for a fresh load report now (its answer wakes the queue)."""
        if len(self.queue):
            self.poller.poll_now(address)
            self.queue.notify()  # prefill's own blocks may be free too

    async def _generate_locally(self, request_id, prompt_ids, produced, sp, reasons, failed_mid_stream):
        if self.metrics is not None:
            self.metrics.local_fallbacks.labels(reason="decode_failed" if failed_mid_stream else "no_decode").inc()
        log.info("request %s: decoding locally (%s)", request_id, "; ".join(reasons))
        self.local_requests += 1
        sp_now = resumed(sp, len(produced))
        outputs = self.engine.generate(f"{request_id}.local", prompt_ids + produced, sp_now)
        try:
            async for out in outputs:
                if out.error:
                    raise DecodeFailed(f"local decoding failed: {out.error}")
                yield Delta(list(out.new_token_ids), out.finished, out.finish_reason if out.finished else None,
                            out.logprobs, out.prompt_logprobs)
                if out.finished:
                    return
        except self.out_of_blocks_error as exc:
            raise NoDecodeAvailable(f"local fallback cannot take the request: {exc}") from None
        finally:
            await outputs.aclose()
            self.local_requests -= 1

    def _decode_overlap(self, ids: list[int]) -> tuple[dict[str, int], int]:
        """Leading blocks of ``ids`` each known decode holds (at most the reusable ones), and how many
        blocks a decode could reuse at most; ({}, 0) without decode reuse or an index."""
        if not self.decode_reuse or self.decode_index is None:
            return {}, 0
        hashes = reusable_hashes(ids, self.block_size)
        if not hashes:
            return {}, 0
        return {address: self.decode_index.overlap(address, hashes) for address in self.picker.known()}, len(hashes)

    def _keep_timings(self, request_id: str, timings: SessionTimings) -> None:
        self.last_timings[request_id] = timings
        while len(self.last_timings) > 256:
            self.last_timings.pop(next(iter(self.last_timings)))


def resumed(sp, produced: int):
    """The SamplingParams for a request resumed after ``produced`` tokens (sent as part of the prompt):
    max_tokens reduced by them, a grammar told to accept them first (its state at the resume point), the
    seeded draws going on at their position, and no prompt logprobs (the client got them with its first
    tokens)."""
    if not produced:
        return sp
    grammar = sp.grammar if sp.grammar is None else replace(sp.grammar, feed=sp.grammar.feed + produced)
    return replace(sp, max_tokens=sp.max_tokens - produced, grammar=grammar, prompt_logprobs=None,
                   seed_position=sp.seed_position + produced)
