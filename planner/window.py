"""The planner's input: what both pools did over one observation window.

A ``Window`` is built from two scrapes of the servers' /metrics (``observe.py``), or by
whatever else can fill it in; the planner never sees where it came from.
Latencies are the client's view, recorded by the prefills for every request (decodes do not
see the client), so ``ttft_s`` and ``tbt_s`` belong to the window, not to one pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PoolLoad:
    """One pool over the window, summed over the replicas that reported.

    - ``replicas``: replicas whose metrics are in the window (ready ones).
    - ``waiting`` / ``running``: requests at the window's end. Prefill: in flight before their
      first token (queued for a decode's KV or for compute) / past it (streaming). Decode:
      sessions not decoding yet (KV arriving) / in the running batch.
    - ``waiting_growth_per_s``: how fast ``waiting`` grew over the window (a burst).
    - ``kv_utilisation``: KV blocks in use / all blocks (None: not reported).
    - ``busy``: prefill only: the fraction of the window its engine spent running steps, per
      replica (``pdserve_engine_busy_seconds_total``: one engine thread, so at most 1; None: not
      known).
    - ``tokens_per_s``: prefill: prompt tokens accepted; decode: tokens generated.
    """

    replicas: int
    waiting: float = 0.0
    running: float = 0.0
    waiting_growth_per_s: float = 0.0
    kv_utilisation: float | None = None
    busy: float | None = None
    tokens_per_s: float = 0.0

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")
        for name in ("waiting", "running", "tokens_per_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.kv_utilisation is not None and not 0 <= self.kv_utilisation <= 1:
            raise ValueError(f"kv_utilisation must be in [0, 1], got {self.kv_utilisation}")
        if self.busy is not None and self.busy < 0:
            raise ValueError(f"busy must be >= 0, got {self.busy}")

    @property
    def in_flight(self) -> float:
        return self.waiting + self.running


@dataclass(frozen=True, slots=True)
class Window:
    """Both pools over ``duration_s`` seconds ending at ``end`` (the caller's clock)."""

    end: float
    duration_s: float
    prefill: PoolLoad
    decode: PoolLoad
    ttft_s: float | None = None     # time to first token at the configured quantile (None: no request)
    tbt_s: float | None = None      # time between tokens at the configured quantile
    requests: int = 0               # first tokens in the window: how far the percentiles can be trusted
    notes: tuple[str, ...] = field(default=())  # what the observer could not read (carried into reasons)

    def __post_init__(self) -> None:
        if not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        for name in ("ttft_s", "tbt_s"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.requests < 0:
            raise ValueError(f"requests must be >= 0, got {self.requests}")

    def pool(self, name: str) -> PoolLoad:
        return self.prefill if name == "prefill" else self.decode
