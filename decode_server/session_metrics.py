"""SessionMetrics: what decode records about its Sessions (Prometheus; no-ops without it).

Contract (called on the event loop by ``DecodeSession`` and ``DecodeEngine``):

1. ``refused(code)`` - admission or the engine refused a Start;
2. ``blocks_changed()`` - the engine reserved or freed blocks: refresh the KV gauges;
3. ``kv_in(seconds, moved, reused)`` - every KV layer and the first token are in, ``seconds``
   after the allocation: observe the wait, count the bytes received (the ``moved`` blocks
   only) and the prompt blocks by source (moved / reused from our prefix cache);
   ``prompt_blocks(reused, computed)`` - the same count when prefill said ComputePrompt;
4. ``request_done(outcome, reason)`` - a session ended (after it left the registry):
   count it and refresh the running / waiting gauges.
5. ``prefill_rate(rate)`` - the measured speed of the prompts computed here changed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .registry import SessionRegistry

if TYPE_CHECKING:
    from pdserve.engine import AsyncLLMEngine
    from pdserve.metrics import ServerMetrics


class SessionMetrics:
    def __init__(self, metrics: ServerMetrics | None, registry: SessionRegistry, engine: AsyncLLMEngine,
                 kv_bytes_per_block: int):
        self.metrics, self.registry, self.engine = metrics, registry, engine
        self.kv_bytes_per_block = kv_bytes_per_block

    def refused(self, code: str) -> None:
        if self.metrics is not None:
            self.metrics.kv_allocation_refusals.labels(reason=code).inc()

    def blocks_changed(self) -> None:
        if self.metrics is not None:
            free = self.engine.num_free_blocks()
            self.metrics.kv_blocks_free.set(free)
            self.metrics.kv_blocks_used.set(self.engine.num_blocks - free)

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
            running = self.registry.running()
            self.metrics.requests_running.set(running)
            self.metrics.requests_waiting.set(len(self.registry) - running)
