"""LinkModel: a modelled link for a simulated cluster (``--engine sim``'s ``--sim-link-gbps``, issue 50).

A simulated server's KV pool may be a scaled-down stand-in for a large model's (``--sim-kv-scale N``: each
block carries 1/N of its real bytes, so 40 servers of an 8B shape fit one small box), and loopback is not the
link being modelled. The sender then paces what it sends as the modelled link would carry the real bytes:

- every slice of ``nbytes`` (scaled) stands for ``nbytes * payload_scale`` real bytes;
- the link (one per sender: the prefill's NIC, shared by all its receivers) is busy for
  ``real_bytes / bandwidth`` per slice, slices in the order they are sent (a FIFO queue on the wire);
- a slice is delivered ``latency`` after its last byte leaves (propagation: slices in flight overlap it);

so ``wait(nbytes)`` blocks the sending thread until the slice's modelled delivery time and only then are the
scaled bytes handed to the socket. With a real link (no ``--sim-link-gbps``) there is no LinkModel and bytes
move at the wire's own speed. ``sleep`` and ``clock`` are injectable (unit tests).
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class LinkModel:
    def __init__(self, bandwidth_bytes_s: float, latency_s: float = 0.0, payload_scale: int = 1,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        if not bandwidth_bytes_s > 0:
            raise ValueError(f"modelled link bandwidth must be > 0 bytes/s, got {bandwidth_bytes_s}")
        if latency_s < 0:
            raise ValueError(f"modelled link latency must be >= 0 s, got {latency_s}")
        if payload_scale < 1:
            raise ValueError(f"payload scale must be >= 1, got {payload_scale}")
        self.bandwidth, self.latency, self.scale = float(bandwidth_bytes_s), float(latency_s), int(payload_scale)
        self.clock, self.sleep = clock, sleep
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the modelled wire has sent everything queued so far
        self.modelled_bytes = 0  # real bytes the link has carried (a counter)

    def delivery_time(self, nbytes: int) -> float:
        """Queue a slice of ``nbytes`` scaled bytes on the modelled wire; its delivery time on ``clock``."""
        real = nbytes * self.scale
        with self._lock:
            start = max(self.clock(), self._free_at)
            self._free_at = start + real / self.bandwidth
            self.modelled_bytes += real
            return self._free_at + self.latency

    def wait(self, nbytes: int) -> None:
        """Block until the slice would have been delivered by the modelled link."""
        left = self.delivery_time(nbytes) - self.clock()
        if left > 0:
            self.sleep(left)

    def describe(self) -> str:
        return (f"modelled link {self.bandwidth * 8 / 1e9:g} Gb/s, latency {self.latency * 1e6:g} us, "
                f"payload 1/{self.scale} of the real bytes")
