"""What the planner is told: replica bounds per pool, the SLO targets and its tuning.

Every knob has a default that suits a small cluster; ``PlannerConfig`` validates itself
(``ValueError`` naming the field), so the operator and ``pdserve up`` can hand user input
straight to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

POOLS = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class PoolLimits:
    """The replicas one pool may have."""

    min_replicas: int = 1
    max_replicas: int = 4

    def __post_init__(self) -> None:
        if self.min_replicas < 0:
            raise ValueError(f"min_replicas must be >= 0, got {self.min_replicas}")
        if self.max_replicas < max(1, self.min_replicas):
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= max(1, "
                             f"min_replicas ({self.min_replicas}))")

    def clamp(self, n: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, n))


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """SLO targets, bounds and tuning. Utilisation targets follow the HPA's rule: a pool is
    sized so that its utilisation sits at the target; a ratio within ``tolerance`` of 1 is
    no change."""

    ttft_target_s: float = 1.0            # the SLO: time to first token at ``latency_quantile``
    tbt_target_s: float = 0.1             # the SLO: time between tokens at ``latency_quantile``
    latency_quantile: float = 0.9
    prefill: PoolLimits = field(default_factory=PoolLimits)
    decode: PoolLimits = field(default_factory=PoolLimits)
    tolerance: float = 0.1                # |ratio - 1| below this: no change (the HPA's default)
    kv_target: float = 0.7                # decode: KV blocks in use / all blocks
    busy_target: float = 0.7              # prefill: fraction of the time its engine runs steps
    queue_target: float = 4.0             # prefill: requests waiting for their first token, per replica
    lookahead_s: float = 10.0             # a growing queue is projected this far ahead (burst sizing)
    max_up_factor: float = 2.0            # one decision at most doubles a pool (and adds at least one)
    down_headroom: float = 0.8            # scale down only to where utilisation lands <= headroom * target
    latency_down_fraction: float = 0.7    # ... and only while latency is below this fraction of its target
    latency_confirm: int = 2              # a latency breach alone must last this many decisions in a row
    min_requests: int = 5                 # a percentile over fewer requests is not trusted
    loaded_fraction: float = 0.3          # a pool below this utilisation is "not loaded": latency is not its fault
    down_stabilisation_s: float = 60.0    # scale down to the highest recommendation of this long a window
    cooldown_s: float = 30.0              # no scale-down this soon after a scale-up, nor after another scale-down
    max_down_step: int = 1                # replicas one decision may remove (each one drains first)

    def __post_init__(self) -> None:
        positive = ("ttft_target_s", "tbt_target_s", "queue_target", "lookahead_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("kv_target", "busy_target", "down_headroom", "latency_down_fraction", "latency_quantile"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {self.tolerance}")
        if not 0 <= self.loaded_fraction < 1:
            raise ValueError(f"loaded_fraction must be in [0, 1), got {self.loaded_fraction}")
        if self.max_up_factor < 1:
            raise ValueError(f"max_up_factor must be >= 1, got {self.max_up_factor}")
        for name in ("latency_confirm", "max_down_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("min_requests", "down_stabilisation_s", "cooldown_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def limits(self, pool: str) -> PoolLimits:
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
        return self.prefill if pool == "prefill" else self.decode
