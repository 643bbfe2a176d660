"""SessionMetrics: what decode records about its Sessions (Prometheus; no-ops without it).

Contract (called on the event loop by ``DecodeSession``):

1. ``refused(code)`` - admission or the engine refused a Start;
2. ``kv_in(seconds, moved, reused)`` - every KV layer and the first token are in, ``seconds``
   after the allocation: observe the wait, count the bytes received (the ``moved`` blocks
   only) and the prompt blocks by source (moved / reused from our prefix cache);
   ``prompt_blocks(reused, computed)`` - the same count when prefill said ComputePrompt;
3. ``request_done(outcome, reason)`` - a session ended (after it left the registry): count it.
4. ``prefill_rate(rate)`` - the measured speed of the prompts computed here changed.

The running / waiting and KV block gauges are not set here: they are read from the
registry and the engine at each scrape (``ServerMetrics.track_load`` in cli.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.metrics import ServerMetrics


class SessionMetrics:
    def __init__(self, metrics: ServerMetrics | None, kv_bytes_per_block: int):
        self.metrics = metrics
        self.kv_bytes_per_block = kv_bytes_per_block

    def refused(self, code: str) -> None:
        if self.metrics is not None:
            self.metrics.kv_allocation_refusals.labels(reason=code).inc()

    def kv_in(self, seconds: float, moved: int, reused: int) -> None:
        if self.metrics is not None:
            self.metrics.decode_last_layer_wait.observe(seconds)
            self.metrics.kv_transfer_bytes.inc(moved * self.kv_bytes_per_block)
            self.prompt_blocks(moved=moved, reused=reused)

    def prompt_blocks(self, *, reused: int = 0, moved: int = 0, computed: int = 0) -> None:
        if self.metrics is not None:
            for source, n in (("reused", reused), ("moved", moved), ("computed", computed)):
                if n:
                    self.metrics.kv_prompt_blocks.labels(source=source).inc(n)

    def prefill_rate(self, rate: float | None) -> None:
        if self.metrics is not None and rate:
            self.metrics.prefill_rate.set(rate)

    def request_done(self, outcome: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(outcome=outcome, reason=reason).inc()
