"""SessionMetrics: what decode records about its Sessions (Prometheus; no-ops without it).

Contract (called on the event loop by ``DecodeSession`` and ``DecodeEngine``):

1. ``refused(code)`` - admission or the engine refused a Start;
2. ``blocks_changed()`` - the engine reserved or freed blocks: refresh the KV gauges;
3. ``kv_in(seconds, n_prompt)`` - every KV layer and the first token are in, ``seconds``
   after the allocation: observe the wait and count the bytes received;
4. ``request_done(outcome, reason)`` - a session ended (after it left the registry):
   count it and refresh the running / waiting gauges.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine import blocks_needed

from .registry import SessionRegistry

if TYPE_CHECKING:
    from pdserve.engine import AsyncLLMEngine
    from pdserve.metrics import ServerMetrics


class SessionMetrics:
    def __init__(self, metrics: ServerMetrics | None, registry: SessionRegistry, engine: AsyncLLMEngine,
                 block_size: int, kv_bytes_per_block: int):
        self.metrics, self.registry, self.engine = metrics, registry, engine
        self.block_size, self.kv_bytes_per_block = block_size, kv_bytes_per_block

    def refused(self, code: str) -> None:
        if self.metrics is not None:
            self.metrics.kv_allocation_refusals.labels(reason=code).inc()

    def blocks_changed(self) -> None:
        if self.metrics is not None:
            free = self.engine.num_free_blocks()
            self.metrics.kv_blocks_free.set(free)
            self.metrics.kv_blocks_used.set(self.engine.num_blocks - free)

    def kv_in(self, seconds: float, n_prompt: int) -> None:
        if self.metrics is not None:
            self.metrics.decode_last_layer_wait.observe(seconds)
            blocks = blocks_needed(n_prompt, self.block_size)
            self.metrics.kv_transfer_bytes.inc(blocks * self.kv_bytes_per_block)

    def request_done(self, outcome: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(outcome=outcome, reason=reason).inc()
            running = self.registry.running()
            self.metrics.requests_running.set(running)
            self.metrics.requests_waiting.set(len(self.registry) - running)
