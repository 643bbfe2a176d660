"""The router's own time per request in a window (``router/residence.py``), read from its
``GET /debug/residence`` and matched to the client's requests by ``X-Request-Id``.

``count(url)`` before a window, ``rows(url, since)`` after it: one row per request the router recorded
(its two parts: request seen -> body written to the prefill; the first answer's bytes read -> written to the
client). ``summarize`` gives p50/p99/max of their sum (the figure the P99 <= 5 ms target is judged on), of
each part, and, per request the client saw through the router, its TTFT less the router's own time (the
prefill, the two loopback hops and the client: what the router does not add by its own work), for the
requests at the router side's p99 and above as well.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from .client import Result, pct

ROUTE = "/debug/residence"


def count(router_url: str) -> int | None:
    """Requests the router recorded so far; None: the router has no such route (an older checkout's)."""
    doc = _get(router_url, 1 << 62)
    return None if doc is None else doc["count"]


def rows(router_url: str, since: int) -> list[dict] | None:
    doc = _get(router_url, since)
    return None if doc is None else doc["requests"]


def _get(router_url: str, since: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"{router_url}{ROUTE}?since={since}", timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def _stats(xs: list[float]) -> dict:
    s = sorted(xs)
    return {"p50_ms": _ms(pct(s, 50)), "p90_ms": _ms(pct(s, 90)), "p99_ms": _ms(pct(s, 99)),
            "max_ms": _ms(s[-1] if s else None), "mean_ms": _ms(sum(s) / len(s) if s else None)}


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def summarize(recorded: list[dict], results: list[Result], routed_ids: list[int], target_ms: float = 5.0) -> dict:
    """``recorded``: the router's rows of the window; ``results``: the window's client results, by request index;
    ``routed_ids``: the indexes of the requests sent through the router."""
    total = [r["request_s"] + r["response_s"] for r in recorded]
    out = {"requests": len(recorded), "total": _stats(total),
           "request_part": _stats([r["request_s"] for r in recorded]),
           "response_part": _stats([r["response_s"] for r in recorded]),
           "body_part": _stats([r["body_s"] for r in recorded if r.get("body_s") is not None]),
           "decided_part": _stats([r["decided_s"] for r in recorded if r.get("decided_s") is not None]),
           "over_target": sum(1 for t in total if t * 1e3 > target_ms), "target_ms": target_ms}
    by_id = {r["request_id"]: r for r in recorded if r.get("request_id") is not None}
    joined = []
    for i in routed_ids:
        res, row = results[i], by_id.get(str(i))
        if row is not None and res.ttft is not None and res.status == 200 and not res.error:
            joined.append((res.ttft, row["request_s"] + row["response_s"]))
    out["matched"] = len(joined)
    out["ttft_less_router"] = _stats([t - own for t, own in joined])
    if joined:  # the slowest requests as the client saw them: how much of each was the router's own work
        joined.sort()
        tail = joined[int(0.99 * len(joined)):]
        out["ttft_tail"] = [{"ttft_ms": t * 1e3, "router_ms": own * 1e3} for t, own in tail]
    return out
