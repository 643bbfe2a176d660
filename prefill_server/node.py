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
requests decoded locally. Its parts come built (``wiring.build_node``: the SessionRunner with its
config, observer and registry, the Disaggregator; ``wiring.start``: the picker, the poller and the
admission queue); the node only checks its own settings.

Deadline: ``generate(..., deadline=...)`` (``time.monotonic()`` seconds) is the request's
end-to-end deadline, enforced by the caller (the Frontend cancels this generator when it
passes); each Session carries it to its decode as the gRPC deadline.

A stream begun by another prefill (``generate(..., produced=...)``: the router resumes a stream
whose prefill died, ``pdserve.stream_resume``) starts as a resume after a decode's failure does,
after its tokens.
"""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve import defaults

from .admission_queue import AdmissionQueue, QueueFull, QueueTimeout, RequestTooLarge
from .conductor import RequestConductor
from .decode_index import DecodeIndex
from .decode_session import DecodeFailed, Delta, NoDecodeAvailable, SessionRunner, SessionTimings
from .disaggregator import Disaggregator
from .load_poller import LoadReportPoller
from .picker import DecodePicker

if TYPE_CHECKING:
    from pdserve.engine import AsyncLLMEngine
    from pdserve.metrics import ServerMetrics
    from pdserve.slo import SloRequest

__all__ = ["PrefillNode", "NoDecodeAvailable", "DecodeFailed", "Delta", "QueueFull", "QueueTimeout", "RequestTooLarge"]


@dataclass
class PrefillNode:
    """One prefill process's request path; built by ``wiring.build_node`` (module docstring)."""

    engine: AsyncLLMEngine  # num_blocks, num_free_blocks() (the conductor's fit), generate (local fallback)
    picker: DecodePicker
    poller: LoadReportPoller  # poll_now: a decode where a request ended, while others wait in line
    queue: AdmissionQueue  # the poller's reports wake it (wiring.start), and requests ending here (``freed``)
    session_runner: SessionRunner  # one Session with a decode per attempt
    disaggregator: Disaggregator  # the SessionRunner's; read here for /health
    sessions: dict[str, str]  # request id -> decode address while a Session is open (the SessionRunner's registry)
    block_size: int
    metrics: ServerMetrics | None = None
    max_attempts: int = 3  # decodes tried a round
    local_fallback: bool = False
    resume: bool = True  # continue on another decode when one fails mid-generation
    resume_wait_s: float = defaults.RESUME_WAIT_S  # after a mid-stream failure, how long to wait for a decode (0: fail)
    out_of_blocks_error: type[Exception] = RuntimeError  # the engine's OutOfBlocksError (local fallback)
    decode_reuse: bool = True  # decodes serve the prompt's cached prefix; only the missing blocks move
    decode_index: DecodeIndex | None = None  # the decodes' prefix caches (their KV events), for the picker
    local_requests: int = 0  # requests decoding on our engine now (local fallback)
    last_timings: dict[str, SessionTimings] = field(default_factory=dict)  # the latest 256 requests'

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not self.resume_wait_s >= 0:
            raise ValueError(f"resume_wait_s must be >= 0, got {self.resume_wait_s}")

    def ready(self) -> bool:
        """Ready when a decode is known (or local fallback can serve); a decode that is full now
        still counts: its requests wait in the admission queue (a full pool must not make the
        prefill unready, or routers and Services would send nothing to it: 503s, not waits)."""
        return self.local_fallback or bool(self.picker.usable())

    def why_not_ready(self) -> str:
        """What ``ready()`` misses, in words (the picker's view of the decodes): /ready's 503 reason."""
        return self.picker.why_none()

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
