"""What one window says each pool needs, before any memory of the past (pure).

``recommend(window, pool, config)`` returns a ``Recommendation``: the replicas the signals
call for, counted from the replicas that reported (``PoolLoad.replicas``), the signal that
drove it and a reason a person can read. Rules:

- **Utilisation, HPA-style**: a pool is sized so its utilisation lands at the target,
  ``ceil(n * utilisation / target)``, when the ratio is more than ``tolerance`` above 1.
  Decode: KV utilisation. Prefill: ``busy`` (the share of time its engine runs steps) and the
  queue of requests waiting for a first token, per replica.
- **Queues are projected**: a queue changing at g requests/s counts as ``waiting + g *
  lookahead_s`` (at least 0), so a burst is sized by where it is going, and a backlog the
  current replicas are already draining does not buy replicas it will not need.
- **Blame goes where the queue is**: while decode KV is at or above its target, or requests
  wait at prefill while prefill's own compute is below its target, those requests are
  waiting for decode KV (a pool can be full below 100%: the next request may need more blocks
  than are left); they size decode (KV demand scaled by (in flight + waiting) / in flight),
  not prefill, unless prefill is busy as well.
- **Latency is an up-only signal**: a TTFT / TBT percentile above target (over at least
  ``min_requests`` requests) adds one replica, only if the pool is loaded (utilisation at
  least ``loaded_fraction``): at low load more replicas would not help, so it is reported,
  not acted on. The planner confirms a latency-only breach over ``latency_confirm`` windows.
- **Scale-down is consolidation-aware**: removing replicas spreads their load over the
  survivors, so the pool may shrink to ``ceil(n * utilisation / (target * down_headroom))``:
  the survivors land below the target with room to spare, never above the scale-up line
  (the 2 <-> 1 oscillation of a flat threshold). Latency above ``latency_down_fraction`` of its
  target, or a growing queue, holds the pool where it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import PlannerConfig
from .window import Window


@dataclass(frozen=True, slots=True)
class Recommendation:
    pool: str
    replicas: int           # what the signals call for (unclamped)
    signal: str             # kv | busy | queue | ttft | tbt | idle | steady | hold
    reason: str
    latency_breach: bool = False   # the pool's latency percentile is above target and the pool is loaded
    latency_only: bool = False     # ... and that breach is the only reason to scale up
    hold: bool = False             # the pool must not shrink now (``reason`` says why)


def _ceil(x: float) -> int:
    return math.ceil(round(x, 9))  # 2.0000000001 from float noise is 2, not 3


def _cap_up(n: int, needed: int, cfg: PlannerConfig) -> int:
    return max(n + 1, min(needed, _ceil(n * cfg.max_up_factor)))


def _trusted(window: Window, value: float | None, cfg: PlannerConfig) -> float | None:
    return value if value is not None and window.requests >= cfg.min_requests else None


def projected_waiting(window: Window, cfg: PlannerConfig) -> float:
    """Requests waiting at prefill ``lookahead_s`` from now at the current growth: a burst counts by
    where it is going, a backlog the current replicas are already draining counts for little."""
    p = window.prefill
    return max(0.0, p.waiting + p.waiting_growth_per_s * cfg.lookahead_s)


def decode_bound(window: Window, cfg: PlannerConfig) -> bool:
    """Requests waiting at prefill are waiting for decode KV."""
    kv, busy = window.decode.kv_utilisation, window.prefill.busy
    if kv is None:
        return False
    return kv >= cfg.kv_target or (window.prefill.waiting > 0 and busy is not None and busy < cfg.busy_target)


def recommend(window: Window, pool: str, cfg: PlannerConfig) -> Recommendation:
    return _recommend_decode(window, cfg) if pool == "decode" else _recommend_prefill(window, cfg)


def _pick_up(pool: str, n: int, ups: list[tuple[int, str, str, bool]], cfg: PlannerConfig) -> Recommendation:
    needed, signal, reason, latency = max(ups, key=lambda u: (u[0], not u[3]))
    others = [u[2] for u in ups if u[2] != reason]
    reason = reason + ("; also " + "; ".join(others) if others else "")
    return Recommendation(pool, _cap_up(n, needed, cfg), signal, reason, latency_breach=any(u[3] for u in ups),
                          latency_only=all(u[3] for u in ups))


def _recommend_decode(window: Window, cfg: PlannerConfig) -> Recommendation:
    d, p = window.decode, window.prefill
    n = max(1, d.replicas)
    kv = d.kv_utilisation
    tbt = _trusted(window, window.tbt_s, cfg)
    ups: list[tuple[int, str, str, bool]] = []
    notes: list[str] = []
    waiting = projected_waiting(window, cfg)
    if kv is not None:
        demand, queued = kv, ""
        if decode_bound(window, cfg) and waiting > 0:
            in_flight = max(1.0, d.in_flight)
            demand = kv * (in_flight + waiting) / in_flight
            queued = f" and {p.waiting:.0f} waiting at prefill ({p.waiting_growth_per_s:+.1f}/s)"
        ratio = demand / cfg.kv_target
        if ratio > 1 + cfg.tolerance:
            ups.append((_ceil(n * ratio), "kv", f"decode KV {kv:.2f}{queued} vs target {cfg.kv_target:.2f}", False))
    if tbt is not None and tbt > cfg.tbt_target_s * (1 + cfg.tolerance):
        loaded = (kv or 0.0) >= cfg.loaded_fraction or d.running >= 2 * n
        if loaded:
            ups.append((n + 1, "tbt", f"TBT p{cfg.latency_quantile * 100:.0f} {tbt * 1000:.0f} ms > target "
                                      f"{cfg.tbt_target_s * 1000:.0f} ms", True))
        else:
            notes.append(f"TBT {tbt * 1000:.0f} ms above target at low load (KV {kv or 0:.2f}): not a capacity problem")
    if ups:
        return _pick_up("decode", n, ups, cfg)
    if kv is None:
        return Recommendation("decode", n, "hold", "no decode KV utilisation reported", hold=True)
    if tbt is not None and tbt > cfg.tbt_target_s * cfg.latency_down_fraction:
        return Recommendation("decode", n, "hold", "; ".join(notes) or f"TBT {tbt * 1000:.0f} ms is near its target "
                              f"{cfg.tbt_target_s * 1000:.0f} ms", hold=True)
    if decode_bound(window, cfg) and p.waiting_growth_per_s > 0:
        return Recommendation("decode", n, "hold", "the prefill queue is growing", hold=True)
    if kv == 0 and d.in_flight == 0 and p.in_flight == 0:
        return Recommendation("decode", 0, "idle", "decode idle (no KV in use, nothing in flight)")
    needed = max(1, _ceil(n * kv / (cfg.kv_target * cfg.down_headroom)))
    if needed < n:
        return Recommendation("decode", needed, "kv", f"decode KV {kv:.2f}: {needed} replica(s) would hold it at "
                              f"{kv * n / needed:.2f} (<= {cfg.kv_target * cfg.down_headroom:.2f})")
    return Recommendation("decode", n, "steady",
                          "; ".join(notes) or f"decode KV {kv:.2f} within target {cfg.kv_target:.2f}")


def _recommend_prefill(window: Window, cfg: PlannerConfig) -> Recommendation:
    p = window.prefill
    n = max(1, p.replicas)
    busy = p.busy
    ttft = _trusted(window, window.ttft_s, cfg)
    ups: list[tuple[int, str, str, bool]] = []
    notes: list[str] = []
    waiting = projected_waiting(window, cfg)
    blamed_on_decode = decode_bound(window, cfg) and not (busy is not None and busy >= cfg.busy_target)
    if busy is not None and busy / cfg.busy_target > 1 + cfg.tolerance:
        ups.append((_ceil(n * busy / cfg.busy_target), "busy",
                    f"prefill busy {busy:.2f} vs target {cfg.busy_target:.2f}",
                    False))
    queue_ratio = waiting / (cfg.queue_target * n)
    if queue_ratio > 1 + cfg.tolerance:
        if blamed_on_decode:
            notes.append(f"{p.waiting:.0f} waiting at prefill are waiting for decode KV")
        else:
            ups.append((_ceil(n * queue_ratio), "queue", f"{p.waiting:.0f} waiting for a first token "
                        f"({p.waiting_growth_per_s:+.1f}/s) vs {cfg.queue_target:g} per replica", False))
    if ttft is not None and ttft > cfg.ttft_target_s * (1 + cfg.tolerance):
        loaded = (busy or 0.0) >= cfg.loaded_fraction * cfg.busy_target or p.waiting >= cfg.queue_target * n / 2
        if blamed_on_decode:
            notes.append(f"TTFT {ttft:.2f} s above target while decode KV is full: decode's to fix")
        elif loaded:
            ups.append((n + 1, "ttft", f"TTFT p{cfg.latency_quantile * 100:.0f} {ttft:.2f} s > target "
                                       f"{cfg.ttft_target_s:.2f} s", True))
        else:
            notes.append(f"TTFT {ttft:.2f} s above target at low load (busy {busy or 0:.2f}): not a capacity problem")
    if ups:
        return _pick_up("prefill", n, ups, cfg)
    if busy is None:
        return Recommendation("prefill", n, "hold", "no prefill engine busy time reported", hold=True)
    if ttft is not None and ttft > cfg.ttft_target_s * cfg.latency_down_fraction:
        return Recommendation("prefill", n, "hold", "; ".join(notes) or f"TTFT {ttft:.2f} s is near its target "
                              f"{cfg.ttft_target_s:.2f} s", hold=True)
    if p.waiting_growth_per_s > 0 and p.waiting > 0:
        return Recommendation("prefill", n, "hold", "; ".join(notes) or "the prefill queue is growing", hold=True)
    if p.in_flight == 0 and busy == 0:
        return Recommendation("prefill", 0, "idle", "prefill idle (no compute, nothing in flight)")
    limit = cfg.down_headroom
    needed = max(1, _ceil(n * busy / (cfg.busy_target * limit)), _ceil(p.waiting / (cfg.queue_target * limit)))
    if needed < n:
        return Recommendation("prefill", needed, "busy", f"prefill busy {busy:.2f}: {needed} replica(s) would run at "
                              f"{busy * n / needed:.2f} (<= {cfg.busy_target * limit:.2f})")
    return Recommendation("prefill", n, "steady", "; ".join(notes) or f"prefill busy {busy:.2f} within target "
                          f"{cfg.busy_target:.2f}")
