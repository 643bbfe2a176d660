"""TransferAccounting: what prefill records about a Session with a decode.

Contract (called by ``SessionRunner``, on the event loop):

1. ``allocated(address, blocks_reserved)`` - a decode answered with an Allocation: until
   its next load report, the picker counts those blocks (and their bytes) as taken there,
   so a burst does not pile onto the decode that looked emptiest a moment ago.
2. ``prefilled(tokens, seconds)`` - our engine computed prompt tokens in that many seconds
   of forward passes: the Disaggregator's throughput meter.
3. ``transferred(timings, moved_blocks)`` - every layer of the blocks the decode lacked
   reached it and prefill released its own blocks: the Disaggregator's bandwidth meter gets
   the bytes over the link-busy time; observe compute time, transfer time (whole and per
   layer), bytes moved and prompt blocks by source (moved / reused by the decode). (The KV
   block gauges are read from the engine at each scrape: ``ServerMetrics.track_load``.)
4. ``computed_on_decode(reused_blocks, computed_blocks)`` - the decode computes the prompt:
   prompt blocks by source (reused / computed).

Without Prometheus metrics (``metrics=None``) only the picker and the meters are fed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .picker import DecodePicker
from .session_protocol import SessionTimings

if TYPE_CHECKING:
    from pdserve.metrics import ServerMetrics

    from .disaggregator import Disaggregator


class TransferAccounting:
    """The prefill's ``SessionObserver``: picker accounting and transfer metrics."""

    def __init__(self, picker: DecodePicker, kv_bytes_per_block: int, disaggregator: Disaggregator,
                 metrics: ServerMetrics | None = None):
        self.picker, self.disaggregator, self.metrics = picker, disaggregator, metrics
        self.kv_bytes_per_block = kv_bytes_per_block  # all layers, K and V

    def allocated(self, address: str, blocks_reserved: int) -> None:
        self.picker.note_allocation(address, blocks_reserved, blocks_reserved * self.kv_bytes_per_block)

    def prefilled(self, tokens: int, seconds: float) -> None:
        self.disaggregator.record_prefill(tokens, seconds)

    def transferred(self, timings: SessionTimings, moved_blocks: int) -> None:
        nbytes = moved_blocks * self.kv_bytes_per_block
        self.disaggregator.record_transfer(nbytes, timings.link_busy_s)
        m = self.metrics
        if m is None:
            return
        m.prefill_compute.observe(timings.prefill_done - timings.allocated)
        if timings.layer_stored:
            m.kv_transfer.observe(max(0.0, timings.kv_sent - timings.layer_stored[0]))
        for seconds in timings.layer_send_seconds:
            m.kv_transfer_layer.observe(max(0.0, seconds))
        m.kv_transfer_bytes.inc(nbytes)
        m.kv_prompt_blocks.labels(source="moved").inc(moved_blocks)
        if timings.cached_blocks:
            m.kv_prompt_blocks.labels(source="reused").inc(timings.cached_blocks)

    def computed_on_decode(self, reused_blocks: int, computed_blocks: int) -> None:
        m = self.metrics
        if m is None:
            return
        m.kv_prompt_blocks.labels(source="computed").inc(computed_blocks)
        if reused_blocks:
            m.kv_prompt_blocks.labels(source="reused").inc(reused_blocks)
