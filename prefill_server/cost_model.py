"""Where one request's prompt is computed: here on the prefill with its KV moved to the decode
(``remote``, the P/D path), or on the decode itself (``local``). Pure: no I/O, no clock.

The cost of each, in seconds of added latency summed over the requests it touches, from
measurements (``CostInputs``; none of these is a fixed threshold). The prefill's forward
passes and its transfers are measured as ``LinearCost``s (a fixed time per operation plus
a time per token / per byte, fitted to recent ones: pdserve/rate_meter.py):

    remote = prefill queue + pipeline(compute on prefill, transfer of the missing blocks)
        prefill queue   = prompt tokens already waiting for this prefill's engine * time per token
        compute         = prefill_compute(prompt tokens its own prefix cache does not hold)
        transfer        = link((prompt blocks - blocks the decode holds) * bytes per block)
        pipeline(c, x)  = max(c + x / L, x + c / L) with L layers pushed as they are written
                          (c + x when the push waits for the whole forward pass)
    local  = compute on decode * (1 + requests running there or about to)
        compute on decode = prompt tokens after the decode's cached blocks / the decode's rate
                            (measured by the decode on the prompts it computed, from its load
                            report; until it has one, prefill_compute of them: the same model)
        each running request waits while the decode computes the prompt in its batch

``decide`` picks the cheaper; the reason is a metric label and a log field:
- ``always`` / ``never``: the mode forced it (``--disaggregation always|never``);
- ``unmeasured``: no prefill throughput or link bandwidth measured yet: remote (today's path,
  which measures both);
- ``remote_cheaper`` / ``local_cheaper``: the costs above;
- ``prompt_logprobs``: the request wants its prompt's logprobs (echo with logprobs), which only
  the prefill's forward pass over the whole prompt gives: remote in every mode (disaggregator.py);
- (``remeasure``: the Disaggregator's own rule, disaggregator.py: remote after a long run of
  local decisions, to keep the measurements current.)

Short prompts and prompts the decode mostly holds are cheap to compute there; long ones, or
a decode busy with many running requests, go remote. (On an idle decode with the prefill's
speed, computing there is never dearer than computing here and moving the KV: that is right
while it is idle; the running count it gets rises with each request placed there.)
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.defaults import DISAGGREGATION_MODES as MODES
from pdserve.engine import blocks_needed
from pdserve.rate_meter import LinearCost

REMOTE, LOCAL = "remote", "local"
PROMPT_LOGPROBS = "prompt_logprobs"  # the reason of a decision forced by a request's prompt logprobs


@dataclass(frozen=True, slots=True)
class CostInputs:
    prompt_tokens: int
    block_size: int
    num_layers: int
    kv_bytes_per_block: int  # all layers, K and V
    prefill_cached_blocks: int  # leading prompt blocks this prefill's own prefix cache holds
    decode_cached_blocks: int  # leading prompt blocks the decode holds (its Allocation: pinned)
    prefill_compute: LinearCost | None  # measured: seconds for N prompt tokens on this prefill
    link: LinearCost | None  # measured: link-busy seconds for N bytes of KV (recent transfers)
    decode_tokens_per_s: float | None = None  # measured by the decode; None: not yet
    prefill_queued_tokens: int = 0  # prompt tokens ahead of this one on this prefill's engine
    decode_running: int = 0  # requests in the decode's batch or admitted to join it (its load report + since)
    layerwise: bool = True  # KV pushed layer by layer while the forward pass runs

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.block_size < 1 or self.num_layers < 1:
            raise ValueError(f"prompt_tokens, block_size and num_layers must be >= 1, got {self.prompt_tokens}, "
                             f"{self.block_size}, {self.num_layers}")
        n_blocks = blocks_needed(self.prompt_tokens, self.block_size)
        for name in ("prefill_cached_blocks", "decode_cached_blocks"):
            if not 0 <= getattr(self, name) < n_blocks:
                raise ValueError(f"{name} must be in [0, {n_blocks}) for a prompt of {self.prompt_tokens} tokens, "
                                 f"got {getattr(self, name)}")
        if self.decode_tokens_per_s is not None and not self.decode_tokens_per_s > 0:
            raise ValueError(f"decode_tokens_per_s must be > 0 or None, got {self.decode_tokens_per_s}")
        for name in ("prefill_compute", "link"):
            cost = getattr(self, name)
            if cost is not None and not (cost.fixed_s >= 0 and cost.per_unit_s > 0):
                raise ValueError(f"{name} must have fixed_s >= 0 and per_unit_s > 0, got {cost}")


@dataclass(frozen=True, slots=True)
class Decision:
    where: str  # REMOTE | LOCAL
    reason: str  # always | never | unmeasured | remote_cheaper | local_cheaper | prompt_logprobs
    remote_s: float | None = None
    local_s: float | None = None

    def log_fields(self) -> str:
        costs = "" if self.remote_s is None else f" remote_s={self.remote_s:.4f} local_s={self.local_s:.4f}"
        return f"disaggregation={self.where} reason={self.reason}{costs}"


def pipelined(compute_s: float, transfer_s: float, num_layers: int, layerwise: bool) -> float:
    """Compute then transfer, overlapped layer by layer when ``layerwise``."""
    if not layerwise:
        return compute_s + transfer_s
    return max(compute_s + transfer_s / num_layers, transfer_s + compute_s / num_layers)


def _measured(c: CostInputs) -> tuple[LinearCost, LinearCost]:
    """(prefill_compute, link); ValueError while either is unmeasured (``decide`` says "unmeasured" then)."""
    if c.prefill_compute is None or c.link is None:
        raise ValueError("the prefill's compute and the link's cost are not both measured yet")
    return c.prefill_compute, c.link


def remote_seconds(c: CostInputs) -> float:
    prefill_compute, link = _measured(c)
    to_compute = c.prompt_tokens - c.prefill_cached_blocks * c.block_size
    moved = blocks_needed(c.prompt_tokens, c.block_size) - c.decode_cached_blocks
    compute, transfer = prefill_compute.seconds(to_compute), link.seconds(moved * c.kv_bytes_per_block)
    queue = c.prefill_queued_tokens * prefill_compute.per_unit_s
    return queue + pipelined(compute, transfer, c.num_layers, c.layerwise)


def local_seconds(c: CostInputs) -> float:
    to_compute = c.prompt_tokens - c.decode_cached_blocks * c.block_size
    if c.decode_tokens_per_s:
        compute = to_compute / c.decode_tokens_per_s
    else:
        compute = _measured(c)[0].seconds(to_compute)
    return compute * (1 + c.decode_running)


def decide(mode: str, c: CostInputs) -> Decision:
    if mode not in MODES:
        raise ValueError(f"unknown disaggregation mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "always":
        return Decision(REMOTE, "always")
    if mode == "never":
        return Decision(LOCAL, "never")
    if c.prefill_compute is None or c.link is None:
        return Decision(REMOTE, "unmeasured")
    remote, local = remote_seconds(c), local_seconds(c)
    if local < remote:
        return Decision(LOCAL, "local_cheaper", remote, local)
    return Decision(REMOTE, "remote_cheaper", remote, local)


def link_busy_seconds(layer_times: list[tuple[float, float]]) -> float:
    """Seconds the link was busy with one request's KV, from its layers' (stored, delivered)
    times in send order: a layer's time counts from when it was stored or the previous layer
    was delivered, whichever is later (so waiting for the forward pass is not link time)."""
    busy, prev_done = 0.0, None
    for stored, done in layer_times:
        begin = stored if prev_done is None else max(stored, prev_done)
        busy += max(0.0, done - begin)
        prev_done = done if prev_done is None else max(prev_done, done)
    return busy
