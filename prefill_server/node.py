"""PrefillNode: everything one prefill process owns, and the routing of one request.

``generate(request_id, prompt_ids, sampling)`` is the single entry the HTTP and gRPC
front ends call. It yields ``Delta``s and raises:

- ``NoDecodeAvailable`` (-> HTTP 503 / gRPC UNAVAILABLE) when no decode took the request
  after ``max_attempts`` tries and local fallback is off; the message lists every reason;
- ``DecodeFailed`` when a decode failed after tokens reached the client and the request
  could not be resumed.

Routing order: the DecodePicker's choice; on refusal / unreachable / failure before the
first token, the next decode it picks (never one already tried), at most
``max_attempts`` decodes; then, with ``local_fallback``, the colocated engine in this
process; else NoDecodeAvailable.

Resume (``resume=True``, the default): when a decode fails mid-generation, the request
continues on the next decode (or locally) by prefilling prompt + the tokens generated so
far, with max_tokens reduced by those tokens; the client's stream just goes on. Greedy
requests give exactly the tokens they would have; seeded random sampling restarts its
per-position random stream at the resume point (so the continuation is a valid sample,
not the same one). Without another decode or fallback the client gets the error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from pdserve.protos import session_pb2 as pb

from .decode_session import DecodeFailed, Delta, NoDecodeAvailable, Retryable, SessionTimings, run_session
from .load_poller import LoadReportPoller
from .picker import DecodePicker

log = logging.getLogger(__name__)

__all__ = ["PrefillNode", "NoDecodeAvailable", "DecodeFailed", "Delta"]


@dataclass
class PrefillNode:
    engine: object  # AsyncLLMEngine: prefill_only / release / generate
    sender: object  # CacheStoreSender
    picker: DecodePicker
    poller: LoadReportPoller
    compat: pb.Compat
    block_size: int
    kv_bytes_per_block: int  # all layers, K and V
    eos_token_ids: tuple[int, ...] = ()
    max_attempts: int = 3
    local_fallback: bool = False
    session_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    metrics: object | None = None
    out_of_blocks_error: type = RuntimeError  # the engine's OutOfBlocksError
    resume: bool = True  # continue on another decode when one fails mid-generation

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        self.sessions: dict[str, str] = {}  # request id -> decode address, while a Session is open
        self.local_requests = 0
        self.last_timings: dict[str, SessionTimings] = {}

    # used by run_session
    def stub(self, address: str):
        return self.poller.stub(address)

    def note_allocation(self, address: str, blocks: int) -> None:
        self.picker.note_allocation(address, blocks, blocks * self.kv_bytes_per_block)

    def observe_transfer(self, t: SessionTimings, blocks: int) -> None:
        m = self.metrics
        if m is None:
            return
        m.prefill_compute.observe(t.prefill_done - t.allocated)
        if t.layer_stored:
            m.kv_transfer.observe(max(0.0, t.kv_sent - t.layer_stored[0]))
        m.kv_transfer_bytes.inc(blocks * self.kv_bytes_per_block)
        free = self.engine.engine.num_free_blocks()
        m.kv_blocks_free.set(free)
        m.kv_blocks_used.set(self.engine.engine.num_blocks - free)

    def ready(self) -> bool:
        """Ready when a decode is known (or local fallback can serve)."""
        return self.local_fallback or bool(self.picker.eligible())

    async def generate(self, request_id: str, prompt_ids: list[int], sp):
        tried: set[str] = set()
        reasons: list[str] = []
        produced: list[int] = []  # tokens already given to the client (for resume)
        failed_mid_stream: DecodeFailed | None = None
        m = self.metrics
        for _ in range(self.max_attempts):
            address = self.picker.pick(exclude=tried)
            if address is None:
                if not tried:
                    reasons.append(self.picker.why_none())
                break
            tried.add(address)
            if m is not None:
                m.decode_selections.labels(decode=address).inc()
            timings = SessionTimings()
            sp_now = replace(sp, max_tokens=sp.max_tokens - len(produced)) if produced else sp
            stream = run_session(self, address, request_id, prompt_ids + produced, sp_now, timings)
            try:
                try:
                    first = await stream.__anext__()
                except Retryable as exc:
                    log.info("request %s: %s", request_id, exc.reason)
                    reasons.append(exc.reason)
                    if m is not None:
                        m.decode_retries.labels(reason=exc.code).inc()
                    continue
                self._keep_timings(request_id, timings)
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
                reasons.append(str(exc))
                log.warning("request %s: %s; resuming after %d tokens", request_id, exc, len(produced))
                if m is not None:
                    m.decode_retries.labels(reason="decode_failed").inc()
                if len(produced) >= sp.max_tokens:
                    yield Delta([], True, "length")
                    return
            finally:
                await stream.aclose()
        if self.local_fallback:
            if m is not None:
                m.local_fallbacks.labels(reason="decode_failed" if failed_mid_stream else "no_decode").inc()
            log.info("request %s: decoding locally (%s)", request_id, "; ".join(reasons))
            self.local_requests += 1
            sp_now = replace(sp, max_tokens=sp.max_tokens - len(produced)) if produced else sp
            outputs = self.engine.generate(request_id, prompt_ids + produced, sp_now)
            try:
                async for out in outputs:
                    if out.error:
                        raise DecodeFailed(f"local decoding failed: {out.error}")
                    yield Delta(list(out.new_token_ids), out.finished, out.finish_reason if out.finished else None)
                    if out.finished:
                        return
            except self.out_of_blocks_error as exc:
                raise NoDecodeAvailable(f"local fallback cannot take the request: {exc}") from None
            finally:
                await outputs.aclose()
                self.local_requests -= 1
            return
        if failed_mid_stream is not None:
            raise DecodeFailed("; ".join(reasons))
        raise NoDecodeAvailable("no decode server could take the request: " + "; ".join(reasons))

    def _keep_timings(self, request_id: str, timings: SessionTimings) -> None:
        self.last_timings[request_id] = timings
        while len(self.last_timings) > 256:
            self.last_timings.pop(next(iter(self.last_timings)))
