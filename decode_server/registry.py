"""SessionRegistry: the live Sessions of one decode process, its draining flag, and the
recent layer-arrival log.

Contract:

1. A ``DecodeSession`` registers its ``SessionInfo`` (``add``) once the engine reserved
   its blocks, moves ``info.stage`` along (allocate -> transfer -> decode) and removes it
   (``remove``) in its release step, whatever happened; a request id has at most one live
   session here.
2. ``draining`` is set once, on SIGTERM/SIGINT: sessions admitted from then on are refused.
3. ``arrivals`` keeps the per-layer KV arrival times of the last 256 requests for
   ``/debug/requests/{rid}``; nothing else reads it.

/health, load reports and the request gauges read ``running()`` / ``waiting()`` /
``stage_counts()``; everything here is used from the event loop only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

ARRIVALS_KEPT = 256


@dataclass(slots=True)
class SessionInfo:
    """What /health shows about one live session."""

    request_id: str
    stage: str
    started: float = field(default_factory=time.monotonic)
    num_blocks: int = 0


class SessionRegistry:
    def __init__(self) -> None:
        self.sessions: dict[str, SessionInfo] = {}
        self.draining = False
        self.arrivals: dict[str, list[float]] = {}  # request id -> monotonic arrival time per layer

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.sessions

    def __len__(self) -> int:
        return len(self.sessions)

    def add(self, info: SessionInfo) -> None:
        self.sessions[info.request_id] = info

    def remove(self, info: SessionInfo) -> bool:
        """Forget ``info``'s session if it is still the registered one; True when it was."""
        if self.sessions.get(info.request_id) is not info:
            return False
        del self.sessions[info.request_id]
        return True

    def remember_arrivals(self, request_id: str, times: list[float]) -> None:
        """Keep ``times`` (filled in later by the session) for /debug/requests."""
        self.arrivals[request_id] = times
        while len(self.arrivals) > ARRIVALS_KEPT:
            self.arrivals.pop(next(iter(self.arrivals)))

    def running(self) -> int:
        return sum(1 for s in self.sessions.values() if s.stage == "decode")

    def waiting(self) -> int:
        return len(self.sessions) - self.running()

    def stage_counts(self) -> dict[str, int]:
        stages: dict[str, int] = {}
        for info in list(self.sessions.values()):
            stages[info.stage] = stages.get(info.stage, 0) + 1
        return stages
