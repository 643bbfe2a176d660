"""From Prometheus to a ``Window`` (pure): the PromQL the operator sends, and the Window it makes
of the answers.

``window_queries(labels, window_s, quantile)`` -> {signal: PromQL}; ``labels`` select one
InferenceService's series (``inference_service`` and, when Prometheus attaches it as its
Kubernetes scrape configs and ServiceMonitors do, ``namespace``), plus ``pool`` to narrow the
decode side to one decode pool. The caller runs each query (instant queries) and hands the
numbers to ``window_from_values`` with the ready replicas of each pool (from the pools'
status: a series of a pod gone a minute ago is still in Prometheus, a ready count is not).

The same rules as ``observe.py``: latencies from the prefills' histograms at the quantile,
counters as rates over the window (prefill busy: the engines' own busy seconds), KV utilisation
and requests running averaged over it, the queue now and its change over the window.
``pod_load_query`` ranks a pool's pods by requests in flight (by the ``pod`` label), for the
pod-deletion cost of a scale-down.
"""

from __future__ import annotations

import math

from .observe import ENGINE_BUSY, GENERATION_TOKENS, KV_FREE, KV_USED, PROMPT_TOKENS, RUNNING, TBT, TTFT, WAITING
from .window import PoolLoad, Window


def _matchers(labels: dict[str, str], **more: str) -> str:
    items = {**labels, **more}
    for key, value in items.items():
        if not key.replace("_", "a").isalnum() or key[0].isdigit():
            raise ValueError(f"not a Prometheus label name: {key!r}")
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(items.items())) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def window_queries(labels: dict[str, str], window_s: float, quantile: float = 0.9,
                   decode_pool: str | None = None) -> dict[str, str]:
    if not window_s >= 1:
        raise ValueError(f"window_s must be >= 1 (Prometheus range), got {window_s}")
    w = f"[{int(window_s)}s]"
    p = _matchers(labels, role="prefill")
    d = _matchers(labels, role="decode", **({"pool": decode_pool} if decode_pool else {}))
    return {
        "ttft": f"histogram_quantile({quantile}, sum by (le) (rate({TTFT}_bucket{p}{w})))",
        "tbt": f"histogram_quantile({quantile}, sum by (le) (rate({TBT}_bucket{p}{w})))",
        "requests": f"sum(increase({TTFT}_count{p}{w}))",
        "prefill_busy": f"sum(rate({ENGINE_BUSY}{p}{w}))",
        "prefill_waiting": f"sum({WAITING}{p})",
        "prefill_waiting_delta": f"sum(delta({WAITING}{p}{w}))",
        "prefill_running": f"sum(avg_over_time({RUNNING}{p}{w}))",
        "prompt_tokens": f"sum(rate({PROMPT_TOKENS}{p}{w}))",
        "generation_tokens": f"sum(rate({GENERATION_TOKENS}{p}{w}))",
        "kv_used": f"sum(avg_over_time({KV_USED}{d}{w}))",
        "kv_free": f"sum(avg_over_time({KV_FREE}{d}{w}))",
        "decode_running": f"sum(avg_over_time({RUNNING}{d}{w}))",
        "decode_waiting": f"sum({WAITING}{d})",
        "decode_waiting_delta": f"sum(delta({WAITING}{d}{w}))",
    }


def pod_load_query(labels: dict[str, str], role: str, pool: str | None = None) -> str:
    """Requests in flight per pod of one pool (waiting + running), by the ``pod`` label."""
    sel = _matchers(labels, role=role, **({"pool": pool} if pool else {}))
    return f"sum by (pod) ({RUNNING}{sel}) + sum by (pod) ({WAITING}{sel})"


def _num(values: dict, key: str) -> float | None:
    v = values.get(key)
    return None if v is None or math.isnan(v) or math.isinf(v) else float(v)


def window_from_values(values: dict[str, float | None], window_s: float, end: float, prefill_ready: int,
                       decode_ready: int) -> Window:
    """The Window of the query answers (a missing or NaN answer: nothing observed)."""
    n = lambda key: _num(values, key) or 0.0  # noqa: E731
    used, free = _num(values, "kv_used"), _num(values, "kv_free")
    kv = min(1.0, max(0.0, used / (used + free))) if used is not None and free is not None and used + free > 0 else None
    busy_s = _num(values, "prefill_busy")  # the prefill engines' seconds in steps per second, summed
    busy = busy_s / prefill_ready if busy_s is not None and prefill_ready > 0 else None
    notes = () if kv is not None or decode_ready == 0 else ("Prometheus has no decode KV series",)
    return Window(
        end=end, duration_s=window_s, ttft_s=_num(values, "ttft"), tbt_s=_num(values, "tbt"),
        requests=int(round(n("requests"))), notes=notes,
        prefill=PoolLoad(prefill_ready, waiting=max(0.0, n("prefill_waiting")), running=max(0.0, n("prefill_running")),
                         waiting_growth_per_s=n("prefill_waiting_delta") / window_s, busy=busy,
                         tokens_per_s=max(0.0, n("prompt_tokens"))),
        decode=PoolLoad(decode_ready, waiting=max(0.0, n("decode_waiting")), running=max(0.0, n("decode_running")),
                        waiting_growth_per_s=n("decode_waiting_delta") / window_s, kv_utilisation=kv,
                        tokens_per_s=max(0.0, n("generation_tokens"))),
    )
