"""TransferAccounting: what prefill records about a Session with a decode.

Contract (called by ``SessionRunner``, on the event loop):

1. ``allocated(address, blocks_reserved)`` - a decode answered with an Allocation: until
   its next load report, the picker counts those blocks (and their bytes) as taken there,
   so a burst does not pile onto the decode that looked emptiest a moment ago.
2. ``transferred(timings, blocks)`` - every layer of the request's KV reached the decode and
   prefill released its own blocks: observe compute time, transfer time (whole and per
   layer) and bytes. (The KV block gauges are read from the engine at each scrape:
   ``ServerMetrics.track_load`` in cli.py.)

Without Prometheus metrics (``metrics=None``) step 2 records nothing; step 1 always runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .decode_session import SessionTimings
from .picker import DecodePicker

if TYPE_CHECKING:
    from pdserve.metrics import ServerMetrics


class TransferAccounting:
    """The prefill's ``SessionObserver``: picker accounting and transfer metrics."""

    def __init__(self, picker: DecodePicker, kv_bytes_per_block: int, metrics: ServerMetrics | None = None):
        self.picker, self.metrics = picker, metrics
        self.kv_bytes_per_block = kv_bytes_per_block  # all layers, K and V

    def allocated(self, address: str, blocks_reserved: int) -> None:
        self.picker.note_allocation(address, blocks_reserved, blocks_reserved * self.kv_bytes_per_block)

    def transferred(self, timings: SessionTimings, blocks: int) -> None:
        m = self.metrics
        if m is None:
            return
        m.prefill_compute.observe(timings.prefill_done - timings.allocated)
        if timings.layer_stored:
            m.kv_transfer.observe(max(0.0, timings.kv_sent - timings.layer_stored[0]))
        for seconds in timings.layer_send_seconds:
            m.kv_transfer_layer.observe(max(0.0, seconds))
        m.kv_transfer_bytes.inc(blocks * self.kv_bytes_per_block)
