"""From the servers' own /metrics to a ``Window`` (pure): two snapshots, one window.

A ``Snapshot`` is every ready replica's parsed /metrics (``exposition.parse``) at one time,
by pool and replica name. ``window_over(snapshots)`` turns the snapshots of one window (the
first at its start, the last at its end) into the planner's ``Window``
(``window_between(before, after)`` is the two-snapshot case):

- latencies: the TTFT and TBT histograms (recorded by the prefills) differenced per replica,
  summed by bucket, and read at the quantile the way PromQL's ``histogram_quantile`` does
  (linear within a bucket);
- counters (prompt / generation tokens, the engine's busy seconds) differenced per replica; a
  counter that went down is a restarted replica, whose new value is its whole delta (as
  PromQL's ``rate`` treats a reset); replicas missing from either snapshot are left out;
- prefill ``busy``: the growth of each prefill engine's own busy time (``ENGINE_BUSY``: seconds its
  one engine thread spent in steps, which never overlap) over the window, per replica that reports
  it: at most 1. Not the requests' compute intervals (``pdserve_prefill_compute_seconds``): those
  overlap whenever a step batches several prompts, and their sum read several times a prefill's
  real busy time in the compressed-day experiment (docs/benchmarks.md);
- gauges summed over replicas: requests waiting at each end (the queue now, and its growth);
  KV utilisation and requests running averaged over the snapshots after the first (one
  sample of a gauge is noisy: a decode holding two requests jumps 0 -> 0.5 -> 1).

The series read are named in ``SERIES``; ``tests/unit/test_planner_observe.py`` checks each
against ``pdserve.metrics``, the one table of metrics (imported there, not here: the
operator, which uses the planner, must not load the metrics library).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .exposition import Samples, total
from .window import PoolLoad, Window

TTFT = "pdserve_time_to_first_token_seconds"
TBT = "pdserve_time_between_tokens_seconds"
ENGINE_BUSY = "pdserve_engine_busy_seconds_total"
PROMPT_TOKENS = "pdserve_prompt_tokens_total"
GENERATION_TOKENS = "pdserve_generation_tokens_total"
WAITING = "pdserve_requests_waiting"
RUNNING = "pdserve_requests_running"
KV_USED = "pdserve_kv_blocks_used"
KV_FREE = "pdserve_kv_blocks_free"
SERIES = (f"{TTFT}_bucket", f"{TTFT}_count", f"{TBT}_bucket", ENGINE_BUSY, PROMPT_TOKENS,
          GENERATION_TOKENS, WAITING, RUNNING, KV_USED, KV_FREE)


@dataclass(frozen=True, slots=True)
class Snapshot:
    at: float
    prefill: dict[str, Samples] = field(default_factory=dict)  # replica name -> its parsed /metrics
    decode: dict[str, Samples] = field(default_factory=dict)


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The q-quantile of a cumulative histogram ``{upper bound: count}`` (PromQL's way); None if empty."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower  # the highest finite bound: all PromQL can say
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def _buckets(samples: Samples, name: str) -> dict[float, float]:
    out: dict[float, float] = {}
    for labels, value in samples.get(f"{name}_bucket", ()):
        le = float(labels.get("le", "nan"))
        if not math.isnan(le) and not math.isnan(value):
            out[le] = out.get(le, 0.0) + value
    return out


def _histogram_delta(before: dict[str, Samples], after: dict[str, Samples], name: str) -> dict[float, float]:
    summed: dict[float, float] = {}
    for replica in set(before) & set(after):
        old, new = _buckets(before[replica], name), _buckets(after[replica], name)
        reset = any(new.get(le, 0.0) < count for le, count in old.items())
        for le, count in new.items():
            summed[le] = summed.get(le, 0.0) + (count if reset else count - old.get(le, 0.0))
    return summed


def _counter_delta(before: dict[str, Samples], after: dict[str, Samples], name: str) -> float:
    out = 0.0
    for replica in set(before) & set(after):
        old, new = total(before[replica], name), total(after[replica], name)
        out += new if new < old else new - old
    return out


def _busy(before: dict[str, Samples], after: dict[str, Samples], dt: float) -> float | None:
    """The engines' busy fraction of the window, per replica in both snapshots that reports its busy time
    (None: none does)."""
    reporting = {r for r in set(before) & set(after) if ENGINE_BUSY in after[r] and ENGINE_BUSY in before[r]}
    if not reporting:
        return None
    seconds = _counter_delta({r: before[r] for r in reporting}, {r: after[r] for r in reporting}, ENGINE_BUSY)
    return seconds / dt / len(reporting)


def _gauge(replicas: dict[str, Samples], name: str) -> float:
    return sum(total(s, name) for s in replicas.values())


def _pool(before: dict[str, Samples], after: dict[str, Samples], dt: float, tokens: float, busy: float | None,
          kv: float | None, running: float) -> PoolLoad:
    waiting = max(0.0, _gauge(after, WAITING))
    growth = (waiting - max(0.0, _gauge(before, WAITING))) / dt
    return PoolLoad(replicas=len(after), waiting=waiting, running=max(0.0, running), waiting_growth_per_s=growth,
                    kv_utilisation=kv, busy=busy, tokens_per_s=max(0.0, tokens / dt))


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _kv(decodes: dict[str, Samples]) -> float | None:
    used, free = _gauge(decodes, KV_USED), _gauge(decodes, KV_FREE)
    return min(1.0, max(0.0, used / (used + free))) if used + free > 0 else None


def window_between(before: Snapshot, after: Snapshot, quantile: float = 0.9) -> Window:
    return window_over([before, after], quantile)


def window_over(snapshots: list[Snapshot], quantile: float = 0.9) -> Window:
    if len(snapshots) < 2:
        raise ValueError(f"a window needs at least 2 snapshots, got {len(snapshots)}")
    before, after, inside = snapshots[0], snapshots[-1], snapshots[1:]
    if any(b.at >= a.at for b, a in zip(snapshots, snapshots[1:])):
        raise ValueError(f"snapshots must be in time order, got {[s.at for s in snapshots]}")
    dt = after.at - before.at
    notes = []
    busy = _busy(before.prefill, after.prefill, dt)
    kv = _mean([_kv(s.decode) for s in inside])
    if after.decode and kv is None:
        notes.append("decodes report no KV blocks")
    ttft = _histogram_delta(before.prefill, after.prefill, TTFT)
    requests = int(round(ttft.get(math.inf, 0.0)))
    prompt = _counter_delta(before.prefill, after.prefill, PROMPT_TOKENS)
    generated = _counter_delta(before.prefill, after.prefill, GENERATION_TOKENS)
    return Window(
        end=after.at, duration_s=dt,
        prefill=_pool(before.prefill, after.prefill, dt, prompt, busy, None,
                      _mean([_gauge(s.prefill, RUNNING) for s in inside]) or 0.0),
        decode=_pool(before.decode, after.decode, dt, generated, None, kv,
                     _mean([_gauge(s.decode, RUNNING) for s in inside]) or 0.0),
        ttft_s=histogram_quantile(quantile, ttft), tbt_s=histogram_quantile(quantile, _histogram_delta(
            before.prefill, after.prefill, TBT)),
        requests=requests, notes=tuple(notes),
    )
