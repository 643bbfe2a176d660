"""Every Prometheus metric pdserve exports: the table is ``metric_specs.py`` (one place for the names), built here.

For the servers (prefill and decode), the whole API is::

    from pdserve.metrics import ServerMetrics

    m = ServerMetrics.from_env(role="prefill")          # once per process
    # or ServerMetrics(role="decode", pool="main", inference_service="chat")

    # histograms (seconds) and counters/gauges without extra labels: bound children
    m.ttft.observe(0.120)
    m.prefill_compute.observe(dt)                       # or: with m.prefill_compute.time(): ...
    m.prompt_tokens.inc(n)
    m.kv_blocks_free.set(free); m.kv_blocks_used.set(used)

    # metrics with extra labels: .labels(...) takes only the extra ones
    m.requests.labels(outcome="ok", reason="stop").inc()
    m.decode_selections.labels(decode="127.0.0.1:50052").inc()

    # per-request timing of tokens as the client sees them (TTFT, TBT, e2e, tokens out)
    clock = m.request_clock()           # at arrival
    clock.token()                       # once per token sent to the client
    clock.finish(outcome="ok", reason="stop")   # exactly once; later calls are ignored

    # the /metrics endpoint
    body, content_type = m.render()
    app.router.add_get("/metrics", m.aiohttp_handler)  # aiohttp servers

Labels. Every metric carries ``role`` (prefill|decode), ``pool`` and
``inference_service``; they are fixed per process (flags, or the environment variables
``PDSERVE_POOL`` and ``PDSERVE_INFERENCE_SERVICE`` that the operator sets) and filled in by
ServerMetrics, so callers never pass them. A few metrics add one more label (``METRICS``
below says which): ``outcome`` (ok|error|cancelled), ``reason`` (a short snake_case word:
stop, length, bad_request, no_decode, decode_unreachable, no_kv_blocks, ...) or ``decode``
(the decode's address as prefill knows it). Keep label values from small fixed sets;
never put request ids or prompts in labels.

Who records what (the dashboards in charts/pdserve/dashboards/ query these):

==============================  ========  ================================================
metric                          role      recorded when
==============================  ========  ================================================
ttft, tbt, e2e_latency          prefill   via RequestClock as tokens reach the client
queue_wait                      prefill   request admitted -> a decode allocated (prefill compute starts;
                                          includes its time in the admission queue)
prefill_compute                 prefill   the forward pass over the prompt
kv_transfer                     prefill   first layer sent -> last layer acknowledged
kv_transfer_layer               prefill   one layer's KV send (store -> sent)
decode_last_layer_wait          decode    allocation answered -> last layer + 1st token in
requests                        both      once per request, at its end
prompt_tokens, generation_...   prefill   prompt accepted / each token out (RequestClock)
kv_transfer_bytes               both      bytes of KV sent (prefill) / received (decode): only the
                                          blocks that moved (not those the decode reused)
kv_prompt_blocks                both      a P/D request's prompt blocks by how the decode got them
                                          (source=reused|moved|computed); decode: at admission and
                                          once the KV is in, prefill: as the decode's Allocation said
disaggregation_decisions        prefill   per P/D request: decision=remote|local and its reason
prefill_tokens_per_second       both      measured prompt throughput (prefill: its forward passes;
                                          decode: the prompts it computed itself)
kv_link_bytes_per_second        prefill   measured KV bandwidth of its recent transfers
decode_selections               prefill   the picker chose that decode for a request
decode_retries                  prefill   a decode refused or failed; trying the next one
local_fallbacks                 prefill   no decode could take it; decoding locally
kv_allocation_refusals          decode    decode refused a Session's allocation
kv_checksum_mismatches          both      decode: a request's KV failed its checksum on arrival (the
                                          request is failed, never decoded); prefill: a decode
                                          reported that (the request is retried / resumed elsewhere)
kv_blocks_free / _used          both      read from the engine at each scrape (``track_load``)
engine_busy                     both      the engine's seconds in steps, read at each scrape (one engine
                                          thread: its rate is the engine's utilisation, at most 1; the
                                          planner's prefill ``busy``)
kv_pool_pooled_requests,       decode    --kv-pool: requests served pooled and the blocks they borrowed
_borrowed_blocks, _lent_blocks            (totals), blocks lent to peers now; read at each scrape
kv_tier_hits, _moved_bytes,     both      the engine's KV tiers' running totals (``--kv-host-tier-bytes``,
_move_seconds, _evictions,                ``--kv-disk-tier-*``; tier=host|disk), read at each scrape
_checksum_mismatches,                     (``server_setup.follow_tier_metrics``); absent without tiers
_write_errors, _bytes
requests_running / _waiting     both      read at each scrape (``track_load``): decode: sessions
                                          decoding / still receiving KV; prefill: requests with
                                          a decode Session open (or decoding locally) / admitted
                                          and still waiting for a decode
requests_queued                 prefill   a request joins or leaves the admission queue (every decode full)
known_decodes                   prefill   after each discovery / load-report update
slo_requests, slo_attainment    prefill   once per request at its end (rejected: at arrival), by SLO class
slo_queue_time                  prefill   a request leaves the global queue (``pdserve.slo.GlobalQueue``)
slo_estimate_error              prefill   leaving the queue (part=queue) and at the end (part=e2e)
slo_policy                      prefill   the queue policy places an arrival in line or orders the waiting requests
slo_queued                      prefill   a request joins or leaves the global queue
gc_full_collection              all       each full garbage collection of the process, after it is ready
                                          (``pdserve.gc_pauses``; the router too)
api_key_requests,               prefill,  with --api-key-file: a request the door let in, by the key's
api_key_refusals                router    name (never the key); one it refused with 401, by reason
                                          (missing|invalid); /health, /ready, /metrics not counted
                                          (``pdserve.http_auth``)
==============================  ========  ================================================

The model-server protocol (Gateway API Inference Extension). An InferencePool's endpoint
picker (EPP) scrapes each pod's /metrics for queued and running requests, KV-cache
utilisation and the cache's block size and block count, under vLLM's names, which are its
defaults (``GATEWAY_METRICS``; see docs/gateway.md). A server calls ``track_load(read)`` once
with a function returning its ``EngineLoad``; at every scrape that one reading feeds both
those series and the pdserve_ gauges above, so the two views can never disagree:

===============================  =====================================================
``vllm:num_requests_waiting``    EngineLoad.waiting (TotalQueuedRequests)
``vllm:num_requests_running``    EngineLoad.running (TotalRunningRequests)
``vllm:kv_cache_usage_perc``     used / total KV blocks, 0..1 (KVCacheUtilization)
``vllm:gpu_cache_usage_perc``    the same value under the name EPPs up to v1.1 read
``vllm:cache_config_info``       1, labels ``block_size`` and ``num_gpu_blocks``
===============================  =====================================================

No ``vllm:lora_requests_info``: pdserve serves no LoRA adapters, and the protocol asks for
it only from servers that do.

The router (``pdserve router``) exports its own table, ``ROUTER_METRICS`` (``ServerMetrics(role="router")``
builds it): its requests by outcome, first-byte and end-to-end latency as its client sees
them, its own work per request (arrival -> prefill chosen), its own time on the way to the first
byte without the prefill's (``router_residence``: ``pdserve/router/residence.py``), its decisions by prefill and
reason, prompt blocks and prefix-hit blocks, index resyncs by prefill and reason, index size
and routable prefills.

Each ServerMetrics owns its own CollectorRegistry, so tests may create many in one
process and ``render()`` shows exactly one server's metrics.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from pdserve.defaults import ENV_INFERENCE_SERVICE, ENV_POOL
# the table itself lives in metric_specs.py; these names are re-exported from here
from pdserve.metric_specs import (COMMON_LABELS, FINE_BUCKETS, LATENCY_BUCKETS, METRICS, ROLES,  # noqa: F401
                                  ROUTER_METRICS, MetricSpec)
from pdserve.request_clock import RequestClock


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What a server holds right now, as ``track_load``'s reader returns it at each scrape."""

    waiting: int  # requests admitted and queued (not yet running)
    running: int  # requests being served
    kv_blocks_total: int
    kv_blocks_free: int  # free blocks, cached prefix blocks included (an allocation may take them)
    block_size: int  # tokens per KV block

    @property
    def kv_blocks_used(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_free

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV cache in use, 0..1."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True, slots=True)
class GatewayMetric:
    """One series of the model-server protocol: its (vLLM) name, help, and what it reads."""

    name: str
    help: str
    value: Callable[[EngineLoad], float]
    labels: Callable[[EngineLoad], dict[str, str]] = lambda load: {}


GATEWAY_METRICS: tuple[GatewayMetric, ...] = (
    GatewayMetric("vllm:num_requests_waiting", "Requests queued, not yet running (model-server protocol: "
                  "TotalQueuedRequests).", lambda load: load.waiting),
    GatewayMetric("vllm:num_requests_running", "Requests being served (model-server protocol: TotalRunningRequests).",
                  lambda load: load.running),
    GatewayMetric("vllm:kv_cache_usage_perc", "KV cache blocks in use, 0..1 (model-server protocol: "
                  "KVCacheUtilization).", lambda load: load.kv_usage),
    GatewayMetric("vllm:gpu_cache_usage_perc", "The same as vllm:kv_cache_usage_perc, under the name endpoint "
                  "pickers up to v1.1 read.", lambda load: load.kv_usage),
    GatewayMetric("vllm:cache_config_info", "KV cache configuration in the labels block_size (tokens per block) and "
                  "num_gpu_blocks (blocks in the cache); always 1.", lambda load: 1.0,
                  lambda load: {"block_size": str(load.block_size), "num_gpu_blocks": str(load.kv_blocks_total)}),
)


# The METRICS gauges a tracked server's reading replaces (attribute -> EngineLoad field).
LOAD_GAUGES = {"requests_running": "running", "requests_waiting": "waiting",
               "kv_blocks_free": "kv_blocks_free", "kv_blocks_used": "kv_blocks_used"}


class _LoadCollector:
    """LOAD_GAUGES and GATEWAY_METRICS from one reading of a server's load per scrape."""

    def __init__(self, read: Callable[[], EngineLoad], common: dict[str, str]):
        self.read, self.common = read, common
        self.specs = [spec for spec in METRICS if spec.attr in LOAD_GAUGES]

    def collect(self):
        load = self.read()
        for spec in self.specs:
            family = GaugeMetricFamily(spec.name, spec.help, labels=list(self.common))
            family.add_metric(list(self.common.values()), float(getattr(load, LOAD_GAUGES[spec.attr])))
            yield family
        for gateway in GATEWAY_METRICS:
            labels = {**self.common, **gateway.labels(load)}
            family = GaugeMetricFamily(gateway.name, gateway.help, labels=list(labels))
            family.add_metric(list(labels.values()), float(gateway.value(load)))
            yield family


def exported_series_names() -> set[str]:
    """Every series name a pdserve server can export (histograms as _bucket/_sum/_count)."""
    return {series for spec in METRICS for series in spec.series_names()}


class _Labelled:
    """A metric with extra labels; ``labels(**extra)`` fills in the process's common labels."""

    def __init__(self, name: str, metric, common: dict[str, str], extra: tuple[str, ...]):
        self._name, self._metric, self._common, self._extra = name, metric, common, extra

    def labels(self, **extra: str):
        if set(extra) != set(self._extra):
            raise ValueError(f"{self._name}: labels must be exactly {self._extra}, got {tuple(extra)}")
        return self._metric.labels(**self._common, **{k: str(v) for k, v in extra.items()})


class ServerMetrics:
    """The metrics of one prefill, decode or router process. Attributes are named as in METRICS
    (ROUTER_METRICS for the router)."""

    def __init__(self, role: str, pool: str = "default", inference_service: str = "local",
                 registry: CollectorRegistry | None = None):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        for what, value in (("pool", pool), ("inference_service", inference_service)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{what} must be a non-empty string, got {value!r}")
        self.role, self.pool, self.inference_service = role, pool, inference_service
        self.registry = registry if registry is not None else CollectorRegistry()
        self._tracking = False
        self._families: dict[str, object] = {}
        common = self._common = {"role": role, "pool": pool, "inference_service": inference_service}
        for spec in ROUTER_METRICS if role == "router" else METRICS:
            labelnames = COMMON_LABELS + spec.labels
            if spec.kind == "histogram":
                metric = Histogram(spec.name, spec.help, labelnames, buckets=spec.buckets, registry=self.registry)
            elif spec.kind == "counter":
                # prometheus_client appends _total itself; give it the base name.
                metric = Counter(spec.name.removesuffix("_total"), spec.help, labelnames, registry=self.registry)
            else:
                metric = Gauge(spec.name, spec.help, labelnames, registry=self.registry)
            # Without extra labels the child exists from the start, so it is scraped as 0.
            child = _Labelled(spec.name, metric, common, spec.labels) if spec.labels else metric.labels(**common)
            setattr(self, spec.attr, child)
            self._families[spec.attr] = metric
        self._on_scrape: list = []

    if TYPE_CHECKING:  # the metrics are attributes named in METRICS (set above): the table is their one home
        def __getattr__(self, attr: str) -> Any: ...

    def follow_counter(self, attr: str, read, **labels: str) -> None:
        """Keep the counter ``attr`` (with its extra ``labels``) equal to ``read()`` (a running total
        kept elsewhere, e.g. by the engine), brought up to date at every scrape."""
        counter, last = getattr(self, attr), [0]
        if labels:
            counter = counter.labels(**labels)

        def refresh() -> None:
            now = read()
            if now > last[0]:
                counter.inc(now - last[0])
                last[0] = now
        self._on_scrape.append(refresh)

    def follow_gauge(self, attr: str, read, **labels: str) -> None:
        """Set the gauge ``attr`` (with its extra ``labels``) to ``read()`` at every scrape."""
        gauge = getattr(self, attr)
        if labels:
            gauge = gauge.labels(**labels)
        self._on_scrape.append(lambda: gauge.set(read()))

    @classmethod
    def from_env(cls, role: str, pool: str | None = None, inference_service: str | None = None) -> "ServerMetrics":
        """Labels from arguments when given, else PDSERVE_POOL / PDSERVE_INFERENCE_SERVICE, else defaults."""
        return cls(role, pool or os.environ.get(ENV_POOL) or "default",
                   inference_service or os.environ.get(ENV_INFERENCE_SERVICE) or "local")

    def track_load(self, read: Callable[[], EngineLoad]) -> None:
        """Read the server's load once per scrape: the request and KV block gauges (``LOAD_GAUGES``)
        and the model-server protocol series (``GATEWAY_METRICS``) all show that one reading.

        ``read`` runs where /metrics is served (the event loop): it must be cheap and not block.
        From then on ``set()`` on those four gauges no longer shows. Prefill and decode only.
        """
        if self.role == "router":
            raise ValueError("the router holds no KV cache: track_load is for prefill and decode")
        if self._tracking:
            raise ValueError("track_load was already called for these metrics")
        self._tracking = True
        for attr in LOAD_GAUGES:
            self.registry.unregister(self._families[attr])
        self.registry.register(_LoadCollector(read, self._common))

    def request_clock(self, prompt_tokens: int = 0) -> "RequestClock":
        """Start timing one request now (its arrival); counts its prompt tokens."""
        if prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        return RequestClock(self)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of this server's metrics and its content type."""
        for refresh in self._on_scrape:
            refresh()
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    async def aiohttp_handler(self, request):  # noqa: ARG002 - aiohttp handler signature
        """GET /metrics for an aiohttp application."""
        from aiohttp import web

        body, content_type = self.render()
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = content_type
        return resp
