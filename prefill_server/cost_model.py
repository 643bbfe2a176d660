"""Where one request's prompt is computed: here on the prefill with its KV moved to the decode
(``remote``, the P/D path), or on the decode itself (``local``). Pure: no I/O, no clock.

The cost of each, in seconds of added latency summed over the requests it touches, from
measurements (``CostInputs``; none of these is a fixed threshold):

    remote = prefill queue + pipeline(compute on prefill, transfer of the missing blocks)
        prefill queue   = prompt tokens already waiting for this prefill's engine / its rate
        compute         = prompt tokens its own prefix cache does not hold / its rate
        transfer        = (prompt blocks - blocks the decode holds) * bytes per block / link rate
        pipeline(c, x)  = max(c + x / L, x + c / L) with L layers pushed as they are written
                          (c + x when the push waits for the whole forward pass)
    local  = compute on decode * (1 + requests running there or about to)
        compute on decode = prompt tokens after the decode's cached blocks / the decode's rate
                            (measured by the decode on the prompts it computed, from its load
                            report; until it has one, this prefill's rate: the same model)
        each running request waits while the decode computes the prompt in its batch

``decide`` picks the cheaper; the reason is a metric label and a log field:
- ``always`` / ``never``: the mode forced it (``--disaggregation always|never``);
- ``unmeasured``: no prefill throughput or link bandwidth measured yet: remote (today's path,
  which measures both);
- ``remote_cheaper`` / ``local_cheaper``: the costs above.

Short prompts and prompts the decode mostly holds are cheap to compute there; long ones, or
a decode busy with many running requests, go remote. (On an idle decode with the prefill's
speed, computing there is never dearer than computing here and moving the KV: that is right
while it is idle; the running count it gets rises with each request placed there.)
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.defaults import DISAGGREGATION_MODES as MODES
from pdserve.engine import blocks_needed

REMOTE, LOCAL = "remote", "local"


@dataclass(frozen=True, slots=True)
class CostInputs:
    prompt_tokens: int
    block_size: int
    num_layers: int
    kv_bytes_per_block: int  # all layers, K and V
    prefill_cached_blocks: int  # leading prompt blocks this prefill's own prefix cache holds
    decode_cached_blocks: int  # leading prompt blocks the decode holds (its Allocation: pinned)
    prefill_tokens_per_s: float | None  # measured: this prefill's recent forward passes
    link_bytes_per_s: float | None  # measured: recent transfers, bytes over link-busy time
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
        for name in ("prefill_tokens_per_s", "link_bytes_per_s", "decode_tokens_per_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")


@dataclass(frozen=True, slots=True)
class Decision:
    where: str  # REMOTE | LOCAL
    reason: str  # always | never | unmeasured | remote_cheaper | local_cheaper
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


def remote_seconds(c: CostInputs) -> float:
    rate = c.prefill_tokens_per_s
    to_compute = c.prompt_tokens - c.prefill_cached_blocks * c.block_size
    moved = blocks_needed(c.prompt_tokens, c.block_size) - c.decode_cached_blocks
    transfer = moved * c.kv_bytes_per_block / c.link_bytes_per_s
    return c.prefill_queued_tokens / rate + pipelined(to_compute / rate, transfer, c.num_layers, c.layerwise)


def local_seconds(c: CostInputs) -> float:
    rate = c.decode_tokens_per_s or c.prefill_tokens_per_s
    to_compute = c.prompt_tokens - c.decode_cached_blocks * c.block_size
    return to_compute / rate * (1 + c.decode_running)


def decide(mode: str, c: CostInputs) -> Decision:
    if mode not in MODES:
        raise ValueError(f"unknown disaggregation mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "always":
        return Decision(REMOTE, "always")
    if mode == "never":
        return Decision(LOCAL, "never")
    if c.prefill_tokens_per_s is None or c.link_bytes_per_s is None:
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
