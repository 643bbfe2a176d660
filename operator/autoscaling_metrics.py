"""Where autoscaling reads an InferenceService's metrics: a Prometheus, or the pods themselves.

Both sources answer the same two questions for one round of the planner:

- ``windows(ns, isvc, pools, window_s, quantile, now)`` -> {pool object name: Window}: for
  the PrefillPool a window over every decode pool, for each DecodePool one over that pool's
  decodes (the prefills' side is shared: they record the client's latencies);
- ``pod_loads(ns, isvc, pool)`` -> {pod name: requests in flight}, to rank a pool's pods by
  load before a scale-down.

``PrometheusSource`` sends the instant queries of ``pdserve.planner.promql`` (selecting
``inference_service`` and ``namespace``, as Prometheus' Kubernetes service discovery and
ServiceMonitors label them). ``PodsSource`` scrapes each ready pod's /metrics (the ports of
``pdserve.defaults``) every round and keeps the snapshots of the last window per
InferenceService, as ``pdserve up --autoscale`` does for processes. ``pools`` is a list of
``PoolRef`` (the pool objects with their ready pods and IPs, read by the caller).
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pdserve import defaults
from pdserve.planner import Window
from pdserve.planner.exposition import Samples, parse, total
from pdserve.planner.observe import RUNNING, WAITING, Snapshot, window_over
from pdserve.planner.promql import pod_load_query, window_from_values, window_queries

HTTP_TIMEOUT_S = 5.0


class MetricsUnavailable(RuntimeError):
    """The source could not be read this round (the planner then holds)."""


@dataclass
class PoolRef:
    name: str                # the PrefillPool / DecodePool object
    role: str                # prefill | decode
    pool: str                # the pool label its pods' metrics carry (prefill: "prefill"; decode: spec.poolName)
    ready_pods: dict[str, str] = field(default_factory=dict)  # pod name -> pod IP


class PrometheusSource:
    kind = "prometheus"

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def query(self, expr: str) -> dict[str, float]:
        """An instant query: {the series' `pod` label (or ""): value}."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as resp:
                doc = json.load(resp)
        except (OSError, ValueError) as exc:
            raise MetricsUnavailable(f"Prometheus at {self.url}: {exc}") from None
        if doc.get("status") != "success":
            raise MetricsUnavailable(f"Prometheus at {self.url}: {doc.get('errorType')}: {doc.get('error')}")
        return {r["metric"].get("pod", ""): float(r["value"][1]) for r in doc["data"]["result"]}

    def _labels(self, ns: str, isvc: str) -> dict[str, str]:
        return {"inference_service": isvc, "namespace": ns}

    def windows(self, ns: str, isvc: str, pools: list[PoolRef], window_s: float, quantile: float,
                now: float) -> dict[str, Window]:
        prefill = next((p for p in pools if p.role == "prefill"), None)
        n_prefill = len(prefill.ready_pods) if prefill else 0
        decodes = [p for p in pools if p.role == "decode"]
        out = {}
        for ref in pools:
            scope = None if ref.role == "prefill" else ref.pool
            n_decode = sum(len(d.ready_pods) for d in decodes) if scope is None else len(ref.ready_pods)
            values = {key: next(iter(self.query(expr).values()), None)
                      for key, expr in window_queries(self._labels(ns, isvc), window_s, quantile, scope).items()}
            out[ref.name] = window_from_values(values, window_s, now, n_prefill, n_decode)
        return out

    def pod_loads(self, ns: str, isvc: str, ref: PoolRef) -> dict[str, float]:
        return self.query(pod_load_query(self._labels(ns, isvc), ref.role, ref.pool if ref.role == "decode" else None))


class PodsSource:
    kind = "pods"

    def __init__(self, fetch=None):
        self._fetch = fetch or _fetch
        self._history: dict[str, deque] = {}   # "ns/isvc" -> deque of (time, {pool object: {pod: samples}})
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="scrape")

    def _scrape(self, pools: list[PoolRef]) -> dict[str, dict[str, Samples]]:
        targets = [(ref.name, pod, f"http://{ip}:{_port(ref.role)}/metrics") for ref in pools
                   for pod, ip in sorted(ref.ready_pods.items())]
        texts = list(self._pool.map(lambda t: self._fetch(t[2]), targets))
        out: dict[str, dict[str, Samples]] = {ref.name: {} for ref in pools}
        for (name, pod, _), text in zip(targets, texts):
            if text is not None:
                try:
                    out[name][pod] = parse(text)
                except ValueError:
                    pass  # a garbled page: this pod sits this round out
        return out

    def windows(self, ns: str, isvc: str, pools: list[PoolRef], window_s: float, quantile: float,
                now: float) -> dict[str, Window]:
        history = self._history.setdefault(f"{ns}/{isvc}", deque())
        history.append((now, self._scrape(pools)))
        while len(history) > 2 and history[1][0] <= now - window_s:
            history.popleft()
        if now - history[0][0] < window_s * 0.9:
            return {}  # not a whole window yet
        prefill = [r.name for r in pools if r.role == "prefill"]
        out = {}
        for ref in pools:
            decodes = [r.name for r in pools if r.role == "decode"] if ref.role == "prefill" else [ref.name]
            snaps = [Snapshot(at, _merge(scraped, prefill), _merge(scraped, decodes)) for at, scraped in history]
            out[ref.name] = window_over(snaps, quantile)
        return out

    def pod_loads(self, ns: str, isvc: str, ref: PoolRef) -> dict[str, float]:
        history = self._history.get(f"{ns}/{isvc}")
        if not history:
            return {}
        latest = history[-1][1].get(ref.name, {})
        return {pod: total(s, WAITING) + total(s, RUNNING) for pod, s in latest.items()}

    def forget(self, ns: str, isvc: str) -> None:
        self._history.pop(f"{ns}/{isvc}", None)


def _merge(scraped: dict[str, dict[str, Samples]], names: list[str]) -> dict[str, Samples]:
    return {pod: s for name in names for pod, s in scraped.get(name, {}).items()}


def _port(role: str) -> int:
    return defaults.HTTP_PORT if role == "prefill" else defaults.DECODE_HTTP_PORT


def _fetch(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as resp:
            return resp.read().decode()
    except (OSError, ValueError):
        return None
