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
``conductor.py``'s: ``generate`` creates one conductor per request, given the node's
``ConductorDeps`` (the picker, the admission queue, the SessionRunner, the local fallback, the
routing settings, and two hooks: ``wake_line`` when a Session ends, ``keep_latest`` when a request
started). The node holds that and what outlives a request beside it: the Disaggregator, the
open Sessions (request id -> decode, for /health) and the latest requests' timings. Its parts
come built (``wiring.build_node``: the SessionRunner with its config, observer and registry, the
Disaggregator, the LocalFallback, the deps; ``wiring.start``: the picker, the poller and the
admission queue).

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
from typing import TYPE_CHECKING, AsyncGenerator

from .admission_queue import AdmissionQueue, QueueFull, QueueTimeout, RequestTooLarge
from .conductor import RequestConductor
from .conductor_deps import ConductorDeps
from .decode_session import DecodeFailed, Delta, NoDecodeAvailable, SessionTimings
from .disaggregator import Disaggregator
from .load_poller import LoadReportPoller

if TYPE_CHECKING:
    from pdserve.engine import SamplingParams
    from pdserve.slo import SloRequest

__all__ = ["PrefillNode", "NoDecodeAvailable", "DecodeFailed", "Delta", "QueueFull", "QueueTimeout", "RequestTooLarge",
           "keep_latest", "wake_line"]

KEPT_TIMINGS = 256  # the latest requests' SessionTimings kept for /debug/requests


@dataclass
class PrefillNode:
    """One prefill process's request path; built by ``wiring.build_node`` (module docstring)."""

    deps: ConductorDeps  # what each request's RequestConductor is given
    disaggregator: Disaggregator  # the SessionRunner's; read here for /health
    sessions: dict[str, str]  # request id -> decode address while a Session is open (the SessionRunner's registry)
    last_timings: dict[str, SessionTimings] = field(default_factory=dict)  # the latest requests' (``keep_latest``)

    @property
    def queue(self) -> AdmissionQueue:
        return self.deps.queue

    @property
    def block_size(self) -> int:
        return self.deps.block_size

    @property
    def local_requests(self) -> int:
        """Requests decoding on our engine now (local fallback)."""
        return self.deps.fallback.running if self.deps.fallback is not None else 0

    def ready(self) -> bool:
        """Ready when a decode is known (or local fallback can serve); a decode that is full now
        still counts: its requests wait in the admission queue (a full pool must not make the
        prefill unready, or routers and Services would send nothing to it: 503s, not waits)."""
        return self.deps.fallback is not None or bool(self.deps.picker.usable())

    def why_not_ready(self) -> str:
        """What ``ready()`` misses, in words (the picker's view of the decodes): /ready's 503 reason."""
        return self.deps.picker.why_none()

    async def generate(self, request_id: str, prompt_ids: list[int], sp: SamplingParams,
                       deadline: float | None = None, slo: SloRequest | None = None,
                       produced: list[int] | tuple = ()) -> AsyncGenerator[Delta, None]:
        """``produced``: tokens the client already has (fewer than ``sp.max_tokens``), from a stream another
        prefill began (``pdserve.stream_resume``): the request goes on after them as after a decode's failure."""
        conductor = RequestConductor(self.deps, request_id, prompt_ids, sp, deadline, slo, produced)
        async with aclosing(conductor.deltas()) as deltas:
            async for delta in deltas:
                yield delta


def wake_line(queue: AdmissionQueue, poller: LoadReportPoller, address: str) -> None:
    """A request's Session with ``address`` ended: its blocks there are free. With requests in
    line, ask that decode for a fresh load report now (its answer wakes the queue)."""
    if len(queue):
        poller.poll_now(address)
        queue.notify()  # prefill's own blocks may be free too


def keep_latest(kept: dict[str, SessionTimings], request_id: str, timings: SessionTimings) -> None:
    """The request's SessionTimings, kept for the latest ``KEPT_TIMINGS`` requests."""
    kept[request_id] = timings
    while len(kept) > KEPT_TIMINGS:
        kept.pop(next(iter(kept)))
