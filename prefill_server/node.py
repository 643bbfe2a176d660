"""PrefillNode: everything one prefill process owns; each request is conducted by a ``RequestConductor``.

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

The request's lifecycle (admission turn -> pick a decode -> one attempt -> done / retry another
decode / resume after a mid-stream failure / wait in the queue / local fallback / give up) is
``conductor.py``'s: ``generate`` creates one conductor per request and yields from it. The node
holds what outlives a request: the picker, the load poller, the admission queue (woken by every
fresh load report and by requests ending here), the SessionRunner and Disaggregator, the open
Sessions (request id -> decode, for /health), the latest requests' timings, and the count of
requests decoded locally.

Deadline: ``generate(..., deadline=...)`` (``time.monotonic()`` seconds) is the request's
end-to-end deadline, enforced by the caller (the Frontend cancels this generator when it
passes); each Session carries it to its decode as the gRPC deadline.

A stream begun by another prefill (``generate(..., produced=...)``: the router resumes a stream
whose prefill died, ``pdserve.stream_resume``) starts as a resume after a decode's failure does,
after its tokens.
"""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from pdserve import defaults
from pdserve.defaults import DISAGGREGATION
from pdserve.protos import session_pb2 as pb

from .admission_queue import AdmissionQueue, QueueFull, QueueTimeout, RequestTooLarge
from .conductor import RequestConductor
from .decode_index import DecodeIndex
from .decode_session import DecodeFailed, Delta, NoDecodeAvailable, SessionConfig, SessionRunner, SessionTimings
from .disaggregator import Disaggregator
from .load_poller import LoadReportPoller
from .picker import DecodePicker
from .transfer_accounting import TransferAccounting

if TYPE_CHECKING:
    from pdserve.cachestore import CacheStoreSender
    from pdserve.engine import AsyncLLMEngine
    from pdserve.metrics import ServerMetrics
    from pdserve.slo import GlobalQueue, SloRequest

__all__ = ["PrefillNode", "NoDecodeAvailable", "DecodeFailed", "Delta", "QueueFull", "QueueTimeout", "RequestTooLarge"]


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
        conductor = RequestConductor(self, request_id, prompt_ids, sp, deadline, slo, produced)
        async with aclosing(conductor.deltas()) as deltas:
            async for delta in deltas:
                yield delta

    def freed(self, address: str) -> None:
        """A request's Session with ``address`` ended: its blocks there are free. With requests in
        line, ask that decode for a fresh load report now (its answer wakes the queue)."""
        if len(self.queue):
            self.poller.poll_now(address)
            self.queue.notify()  # prefill's own blocks may be free too

    def keep_timings(self, request_id: str, timings: SessionTimings) -> None:
        """The request's SessionTimings, kept for the latest 256 requests."""
        self.last_timings[request_id] = timings
        while len(self.last_timings) > 256:
            self.last_timings.pop(next(iter(self.last_timings)))
