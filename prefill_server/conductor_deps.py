"""ConductorDeps: what every RequestConductor is given, built once by ``wiring.build_node`` and held
by the PrefillNode (never the node itself: a conductor reaches only these).

The parts it uses, the routing settings it follows, and two hooks into what outlives a request:
``on_session_end`` (a Session with a decode ended: its blocks there are free, so a request waiting
in line may fit now) and ``keep_timings`` (the request started on a decode: its ``SessionTimings``
are kept for /debug/requests). ``MidStreamResume`` is given the same object (the picker's and
the queue's clocks, ``resume_wait_s``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from pdserve.engine.server_engine import ServerEngine
    from pdserve.metrics import ServerMetrics

    from .admission_queue import AdmissionQueue
    from .decode_index import DecodeIndex
    from .decode_session import SessionRunner, SessionTimings
    from .local_fallback import LocalFallback
    from .picker import DecodePicker


@dataclass(frozen=True, slots=True)
class ConductorDeps:
    """Everything a RequestConductor uses (module docstring)."""

    engine: ServerEngine  # num_blocks, num_free_blocks(): does the request fit this prefill now, ever
    picker: DecodePicker  # the decode for each attempt; why none; the decodes' pools; load reports' clock
    queue: AdmissionQueue  # the line (a ticket per request); its clock
    session_runner: SessionRunner  # one Session with a decode per attempt
    block_size: int
    on_session_end: Callable[[str], None]  # a Session with that decode ended: its blocks there are free
    keep_timings: Callable[[str, SessionTimings], None]  # (request id, its timings) once it started on a decode
    max_attempts: int = 3  # decodes tried a round
    resume: bool = True  # continue on another decode when one fails mid-generation
    resume_wait_s: float = 0.0  # after a mid-stream failure, how long to wait for a decode (0: fail at once)
    decode_index: DecodeIndex | None = None  # the decodes' prefix caches (their KV events); None: no decode reuse
    fallback: LocalFallback | None = None  # our colocated engine decodes what no decode took; None: off
    metrics: ServerMetrics | None = None  # decode selections and retries, queue wait

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not self.resume_wait_s >= 0:
            raise ValueError(f"resume_wait_s must be >= 0, got {self.resume_wait_s}")
