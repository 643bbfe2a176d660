"""Disaggregator: the prefill's per-request choice of where a prompt is computed, fed by what
it measured. The cost model itself is pure (cost_model.py); this holds its inputs.

Lifecycle, per P/D request (called by SessionRunner on the event loop):

1. ``prefill_cached_blocks(prompt_ids)`` - leading blocks this prefill's own prefix cache
   holds (its KV-event publisher's mirror of the hash set, read under its lock);
2. after the decode's Allocation, ``decide(address, prompt_ids, decode_cached_blocks)``
   builds ``CostInputs`` from the measurements below and the decode's latest load report
   (requests running or about to run there: its running + waiting sessions, plus the
   sessions this prefill opened there since the report; its measured prompt rate), asks
   ``cost_model.decide``, counts the
   decision (``pdserve_disaggregation_decisions_total{decision, reason}``) and logs it;
3. remote: ``computing(tokens)`` wraps the prefill's forward pass (the tokens waiting for
   this engine are the queue of the next decision); then, via the SessionObserver,
   ``record_prefill`` and ``record_transfer`` feed the meters.

Two rules keep the measurements honest (both count requests, neither looks at costs): the
cost model is used once each meter holds ``MIN_SAMPLES`` samples (until then: remote, reason
``unmeasured``, which measures); and after ``REMEASURE_EVERY`` local decisions in a row the
next request goes remote (reason ``remeasure``), so a prefill that looked slow once is measured
again instead of never being used.

Measurements (``CostMeter``s: a fixed time per operation plus a time per unit, fitted to the
last 32): this prefill's recent forward passes (prompt tokens, from the engine's
``prefill_counters``, prefix hits excluded) and its recent KV transfers (bytes over link-busy
time). Their marginal rates are the gauges ``pdserve_prefill_tokens_per_second`` and
``pdserve_kv_link_bytes_per_second``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Callable

from pdserve.engine import blocks_needed, reusable_hashes
from pdserve.rate_meter import CostMeter

from .cost_model import LOCAL, MODES, PROMPT_LOGPROBS, REMOTE, CostInputs, Decision, decide

if TYPE_CHECKING:
    from pdserve.metrics import ServerMetrics

    from .picker import DecodePicker

log = logging.getLogger(__name__)

MIN_SAMPLES = 3  # samples in each meter before the cost model is used
REMEASURE_EVERY = 32  # local decisions in a row before one remote one (measures again)


class Disaggregator:
    def __init__(self, mode: str, *, picker: DecodePicker, block_size: int, num_layers: int, kv_bytes_per_block: int,
                 layerwise: bool = True, held_prefix: Callable[[list[int]], int] | None = None,
                 metrics: ServerMetrics | None = None):
        if mode not in MODES:
            raise ValueError(f"unknown disaggregation mode {mode!r}; choose one of {', '.join(MODES)}")
        self.mode, self.picker, self.metrics = mode, picker, metrics
        self.block_size, self.num_layers, self.kv_bytes_per_block = block_size, num_layers, kv_bytes_per_block
        self.layerwise = layerwise
        self.held_prefix = held_prefix  # prompt hashes -> leading ones our prefix cache holds
        self.prefill_meter = CostMeter()  # seconds of our forward passes for N prompt tokens
        self.link_meter = CostMeter()  # link-busy seconds for N bytes of KV
        self.queued_tokens = 0  # prompt tokens handed to our engine and not computed yet
        self.local_streak = 0  # local decisions since the last remote one

    # ---- inputs -------------------------------------------------------------------------------
    def prefill_cached_blocks(self, prompt_ids: list[int]) -> int:
        """Leading prompt blocks our prefix cache holds, for ``decide`` (auto mode only; else 0)."""
        return self.held_blocks(prompt_ids) if self.mode == "auto" else 0

    def held_blocks(self, prompt_ids: list[int]) -> int:
        """Leading prompt blocks our prefix cache holds now (0 without the KV events' mirror)."""
        if self.held_prefix is None:
            return 0
        hashes = reusable_hashes(prompt_ids, self.block_size)
        return min(len(hashes), self.held_prefix(hashes))

    @contextlib.contextmanager
    def computing(self, tokens: int):
        """Around a forward pass of ``tokens`` prompt tokens on our engine (the queue others see)."""
        self.queued_tokens += tokens
        try:
            yield
        finally:
            self.queued_tokens -= tokens

    def record_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill_meter.add(tokens, seconds)
        fit = self.prefill_meter.fit()
        if self.metrics is not None and fit is not None:
            self.metrics.prefill_rate.set(fit.rate)

    def record_transfer(self, nbytes: int, seconds: float) -> None:
        self.link_meter.add(nbytes, seconds)
        fit = self.link_meter.fit()
        if self.metrics is not None and fit is not None:
            self.metrics.kv_link_rate.set(fit.rate)

    @staticmethod
    def _fit(meter: CostMeter):
        return meter.fit() if len(meter) >= MIN_SAMPLES else None

    def state(self) -> dict:
        """For /health: the mode, the queue, and the fitted costs (fixed seconds, marginal rate)."""
        out: dict = {"mode": self.mode, "queued_tokens": self.queued_tokens}
        for name, meter in (("prefill_compute", self.prefill_meter), ("link", self.link_meter)):
            fit = meter.fit()
            out[name] = None if fit is None else {"fixed_s": fit.fixed_s, "per_second": fit.rate, "samples": len(meter)}
        return out

    # ---- the decision -------------------------------------------------------------------------
    def decide(self, address: str, request_id: str, prompt_ids: list[int], decode_cached_blocks: int,
               prefill_cached_blocks: int = 0, prompt_logprobs: bool = False) -> Decision:
        """``prompt_logprobs``: the request wants its prompt's logprobs, which only this prefill computes:
        remote whatever the mode and the costs (reason ``prompt_logprobs``)."""
        if prompt_logprobs:
            decision = Decision(REMOTE, PROMPT_LOGPROBS)
        elif self.mode != "auto":
            decision = decide(self.mode, _placeholder(len(prompt_ids), self.block_size, self.num_layers))
        else:
            load = self.picker.load(address)
            inputs = CostInputs(
                prompt_tokens=len(prompt_ids), block_size=self.block_size, num_layers=self.num_layers,
                kv_bytes_per_block=self.kv_bytes_per_block, prefill_cached_blocks=prefill_cached_blocks,
                decode_cached_blocks=decode_cached_blocks, prefill_compute=self._fit(self.prefill_meter),
                link=self._fit(self.link_meter),
                decode_tokens_per_s=(load.prefill_tokens_per_s or None) if load is not None else None,
                prefill_queued_tokens=self.queued_tokens,
                decode_running=load.running + load.waiting if load is not None else 0,
                layerwise=self.layerwise)
            decision = decide(self.mode, inputs)
            self.local_streak = self.local_streak + 1 if decision.where == LOCAL else 0
            if self.local_streak > REMEASURE_EVERY:
                decision, self.local_streak = Decision(REMOTE, "remeasure", decision.remote_s, decision.local_s), 0
        if self.metrics is not None:
            self.metrics.disaggregation_decisions.labels(decision=decision.where, reason=decision.reason).inc()
        level = logging.INFO if self.mode == "auto" else logging.DEBUG
        log.log(level, "request %s: decode=%s prompt_blocks=%d decode_cached=%d prefill_cached=%d %s", request_id,
                address,
                 blocks_needed(len(prompt_ids), self.block_size), decode_cached_blocks, prefill_cached_blocks,
                 decision.log_fields())
        return decision


def _placeholder(n: int, block_size: int, num_layers: int) -> CostInputs:
    """Inputs for a forced mode (always / never): the costs are not looked at."""
    return CostInputs(prompt_tokens=n, block_size=block_size, num_layers=num_layers, kv_bytes_per_block=1,
                      prefill_cached_blocks=0, decode_cached_blocks=0, prefill_compute=None, link=None)
