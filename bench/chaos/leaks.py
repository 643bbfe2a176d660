"""What a server still holds once the load has stopped: must all be zero (pure, unit-tested).

Read from each surviving server after the run:

- ``/metrics`` (names from pdserve/metrics.py): ``pdserve_kv_blocks_used``,
  ``pdserve_requests_running``, ``pdserve_requests_waiting`` (the engine's queue) and
  ``pdserve_requests_queued`` (prefill's admission queue).
- ``/health``: ``sessions`` (live P/D Session streams), the CacheStore's counters of
  things held (pinned entries and blocks, in-flight transfers, waiters; the same keys as
  tests/harness/pd_cluster.py ``HELD_KEYS``), and the prefill's ``in_flight`` requests.
  Sessions and CacheStore entries are not exported as metrics, so /health is the source.

``held_from_metrics`` and ``held_from_health`` turn the raw documents into one flat dict
per server; ``leaks`` keeps the non-zero entries of every server.
"""

from __future__ import annotations

HELD_GAUGES = ("pdserve_kv_blocks_used", "pdserve_requests_running", "pdserve_requests_waiting",
               "pdserve_requests_queued")
HELD_CACHESTORE_KEYS = ("pinned", "inflight", "queued", "sending", "receiving", "waiters")


def held_from_metrics(text: str) -> dict[str, float]:
    """The held gauges of one /metrics page (summed over label sets)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {name: 0.0 for name in HELD_GAUGES}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


def held_from_health(health: dict) -> dict[str, float]:
    """Sessions, CacheStore entries held and in-flight requests of one /health document."""
    out = {"sessions": float(health.get("sessions", 0))}
    for key, value in (health.get("cachestore") or {}).items():
        if isinstance(value, (int, float)) and any(k in key for k in HELD_CACHESTORE_KEYS):
            out[f"cachestore.{key}"] = float(value)
    if "in_flight" in health:
        out["in_flight"] = float(health["in_flight"])
    return out


def leaks(readings: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """server -> {what: value} for every non-zero reading (empty: nothing leaked)."""
    out = {}
    for server, values in readings.items():
        bad = {k: v for k, v in values.items() if v != 0}
        if bad:
            out[server] = bad
    return out
