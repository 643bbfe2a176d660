"""The router's own time on a request's way to its first byte (its residence), per request.

What the router adds to a request's time to first token is two stretches of its own clock
(``time.perf_counter``, monotonic), and nothing of the prefill's:

1. **request**: the HTTP handler sees the request (aiohttp parsed its headers) -> the body written to the
   prefill's connection (``TimedBody``: the moment aiohttp handed the last byte to the transport). In it:
   reading the body, the token ids, the decision, aiohttp's client request; a retry's time on a prefill
   that refused or could not be reached; with SLO classes, the wait in the SLO queue (``slo_queue_time``).
2. **response**: the bytes of the first answer read from the prefill (the chunk that completed the first
   whole SSE event, or the whole body of a plain response) -> those bytes written to the client's
   connection (with its headers).

Between them is the prefill's time and the extra hop (the prefill's reading of the body, its work, its
first byte on the wire back): not the router's, not here. Before 1 (the event loop picking up the client's
bytes) and after 2 (the kernel delivering them) are not here either: the end-to-end A/B of ``pdserve bench
router-scale`` sees those.

``Residences.record`` observes their sum once per request in ``router_residence`` (a Prometheus histogram)
and keeps the last ``RECENT`` requests' two parts (and, of the first, the parts until the body was read,
``body_s``, and until the prefill was chosen, ``decided_s``), each with its sequence number and the
client's ``X-Request-Id`` (if it sent one), for ``GET /debug/residence?since=N`` (``http_api.py``): what a
benchmark reads per request.
"""

from __future__ import annotations

import time
from collections import deque

from aiohttp.payload import BytesPayload

RECENT = 4096  # requests whose parts GET /debug/residence can return
REQUEST_ID_HEADER = "X-Request-Id"


class TimedBody(BytesPayload):
    """A request body for aiohttp's client that notes when it was written (``written_at``: perf_counter)."""

    written_at: float | None = None

    async def write_with_length(self, writer, content_length: int | None) -> None:
        await super().write_with_length(writer, content_length)
        self.written_at = time.perf_counter()

    async def write(self, writer) -> None:
        await super().write(writer)
        self.written_at = time.perf_counter()


class Clock:
    """One request's residence stamps: ``accepted`` (made when the handler starts), ``body`` (its body read),
    ``decided`` (its prefills ranked), ``sent`` (the body written to the prefill whose answer is relayed),
    ``read`` (the first answer's bytes read from it)."""

    __slots__ = ("accepted", "body", "decided", "sent", "read", "request_id", "done")

    def __init__(self, request_id: str | None = None):
        self.accepted = time.perf_counter()
        self.body: float | None = None
        self.decided: float | None = None
        self.sent: float | None = None
        self.read: float | None = None
        self.request_id = request_id
        self.done = False


class Residences:
    """The router's residence per request: the histogram (``metrics.router_residence``) and the recent parts."""

    def __init__(self, metrics, recent: int = RECENT):
        self.metrics = metrics
        self.count = 0  # requests recorded since start (the sequence number of the last one)
        self._recent: deque[tuple[int, float, float, float | None, float | None, str | None]] = deque(maxlen=recent)

    def record(self, clock: Clock, written_at: float) -> None:
        """The first of the answer was written to the client at ``written_at``: observe the request once."""
        if clock.done or clock.sent is None or clock.read is None:
            return
        clock.done = True
        request_s, response_s = clock.sent - clock.accepted, written_at - clock.read
        self.count += 1
        body_s = None if clock.body is None else clock.body - clock.accepted
        decided_s = None if clock.decided is None else clock.decided - clock.accepted
        self._recent.append((self.count, request_s, response_s, body_s, decided_s, clock.request_id))
        self.metrics.router_residence.observe(request_s + response_s)

    def since(self, seq: int) -> dict:
        """The recorded requests after sequence number ``seq`` that are still kept: seconds of each part."""
        rows = [{"seq": n, "request_s": a, "response_s": b, "body_s": r, "decided_s": d, "request_id": rid}
                for n, a, b, r, d, rid in self._recent if n > seq]
        return {"count": self.count, "kept": len(self._recent), "requests": rows}
