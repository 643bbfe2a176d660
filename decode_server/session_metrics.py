"""SessionMetrics: what decode records about its Sessions (Prometheus; no-ops without it).

Contract (called on the event loop by ``DecodeSession``):

1. ``refused(code)`` - admission or the engine refused a Start;
2. ``kv_in(seconds, n_prompt)`` - every KV layer and the first token are in, ``seconds``
   after the allocation: observe the wait and count the bytes received;
3. ``request_done(outcome, reason)`` - a session ended (after it left the registry): count it.

The running / waiting and KV block gauges are not set here: they are read from the
registry and the engine at each scrape (``ServerMetrics.track_load`` in cli.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine import blocks_needed

if TYPE_CHECKING:
    from pdserve.metrics import ServerMetrics


class SessionMetrics:
    def __init__(self, metrics: ServerMetrics | None, block_size: int, kv_bytes_per_block: int):
        self.metrics = metrics
        self.block_size, self.kv_bytes_per_block = block_size, kv_bytes_per_block

    def refused(self, code: str) -> None:
        if self.metrics is not None:
            self.metrics.kv_allocation_refusals.labels(reason=code).inc()

    def kv_in(self, seconds: float, n_prompt: int) -> None:
        if self.metrics is not None:
            self.metrics.decode_last_layer_wait.observe(seconds)
            blocks = blocks_needed(n_prompt, self.block_size)
            self.metrics.kv_transfer_bytes.inc(blocks * self.kv_bytes_per_block)

    def request_done(self, outcome: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(outcome=outcome, reason=reason).inc()
