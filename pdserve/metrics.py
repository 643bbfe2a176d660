"""Every Prometheus metric pdserve exports, defined in one place.

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
them, its own work per request (arrival -> prefill chosen), its decisions by prefill and
reason, prompt blocks and prefix-hit blocks, index resyncs by prefill and reason, index size
and routable prefills.

Each ServerMetrics owns its own CollectorRegistry, so tests may create many in one
process and ``render()`` shows exactly one server's metrics.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from pdserve.defaults import ENV_INFERENCE_SERVICE, ENV_POOL
from pdserve.request_clock import RequestClock

ROLES = ("prefill", "decode", "router")
COMMON_LABELS = ("role", "pool", "inference_service")

# Request-level latencies: 1 ms to 10 minutes.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.5, 5.0, 7.5, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)
# Per-layer and per-token times start lower (100 us) and end at a minute.
FINE_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05,
    0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric: attribute name on ServerMetrics, Prometheus name, kind, help, extra labels."""

    attr: str
    name: str
    kind: str  # histogram | counter | gauge
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = LATENCY_BUCKETS

    def __post_init__(self) -> None:
        if self.kind not in ("histogram", "counter", "gauge"):
            raise ValueError(f"metric {self.name}: unknown kind {self.kind!r}")
        if not self.name.startswith("pdserve_"):
            raise ValueError(f"metric {self.name}: names start with 'pdserve_'")
        if self.kind == "counter" and not self.name.endswith("_total"):
            raise ValueError(f"counter {self.name}: counter names end with '_total'")
        if self.kind == "histogram" and not self.name.endswith("_seconds"):
            raise ValueError(f"histogram {self.name}: histograms here are times and end with '_seconds'")
        if set(self.labels) & set(COMMON_LABELS):
            raise ValueError(f"metric {self.name}: {COMMON_LABELS} are added by ServerMetrics")

    def series_names(self) -> tuple[str, ...]:
        """The names this metric appears under in a scrape (what PromQL can select)."""
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


_H, _C, _G = "histogram", "counter", "gauge"
METRICS: tuple[MetricSpec, ...] = (
    # histograms
    MetricSpec("ttft", "pdserve_time_to_first_token_seconds", _H,
               "Arrival of a request to its first token sent to the client."),
    MetricSpec("tbt", "pdserve_time_between_tokens_seconds", _H,
               "Gap between consecutive tokens sent to the client.", buckets=FINE_BUCKETS),
    MetricSpec("e2e_latency", "pdserve_e2e_request_latency_seconds", _H,
               "Arrival of a request to its last token (or error)."),
    MetricSpec("queue_wait", "pdserve_queue_wait_seconds", _H,
               "Time from a request's arrival until its compute started (prefill: a decode allocated its KV)."),
    MetricSpec("prefill_compute", "pdserve_prefill_compute_seconds", _H,
               "Forward pass over a request's prompt on prefill."),
    MetricSpec("kv_transfer", "pdserve_kv_transfer_seconds", _H,
               "KV transfer of one request, first layer sent to last layer done."),
    MetricSpec("kv_transfer_layer", "pdserve_kv_transfer_layer_seconds", _H,
               "KV transfer of one layer of one request.", buckets=FINE_BUCKETS),
    MetricSpec("decode_last_layer_wait", "pdserve_decode_last_layer_wait_seconds", _H,
               "On decode: allocation answered to last KV layer and first token received."),
    # counters
    MetricSpec("requests", "pdserve_requests_total", _C,
               "Requests finished, by outcome (ok|error|cancelled) and reason.", ("outcome", "reason")),
    MetricSpec("prompt_tokens", "pdserve_prompt_tokens_total", _C, "Prompt tokens accepted."),
    MetricSpec("generation_tokens", "pdserve_generation_tokens_total", _C, "Tokens generated and sent."),
    MetricSpec("kv_transfer_bytes", "pdserve_kv_transfer_bytes_total", _C,
               "KV cache bytes sent (prefill) or received (decode)."),
    MetricSpec("decode_selections", "pdserve_decode_selections_total", _C,
               "Requests the decode picker sent to each decode.", ("decode",)),
    MetricSpec("decode_retries", "pdserve_decode_retries_total", _C,
               "Times prefill moved a request on to another decode, by reason.", ("reason",)),
    MetricSpec("local_fallbacks", "pdserve_local_fallbacks_total", _C,
               "Requests prefill decoded itself because no decode could take them.", ("reason",)),
    MetricSpec("kv_allocation_refusals", "pdserve_kv_allocation_refusals_total", _C,
               "Session allocations decode refused, by reason.", ("reason",)),
    MetricSpec("prompt_tokens_computed", "pdserve_prompt_tokens_computed_total", _C,
               "Prompt tokens this prefill's engine computed for P/D requests (after its prefix-cache hits)."),
    MetricSpec("prefix_cache_hit_tokens", "pdserve_prefix_cache_hit_tokens_total", _C,
               "Prompt tokens whose KV the engine reused from its prefix cache instead of computing or receiving it."),
    MetricSpec("kv_checksum_mismatches", "pdserve_kv_checksum_mismatches_total", _C,
               "Requests whose KV failed its checksum (decode: detected on arrival; prefill: reported by a decode)."),
    MetricSpec("kv_prompt_blocks", "pdserve_kv_prompt_blocks_total", _C,
               "Prompt KV blocks of P/D requests by how the decode got them: reused (its prefix cache), moved "
               "(over the CacheStore), computed (by the decode itself).", ("source",)),
    MetricSpec("disaggregation_decisions", "pdserve_disaggregation_decisions_total", _C,
               "Prefill: where each P/D request's prompt was computed (decision=remote|local) and why.",
               ("decision", "reason")),
    # gauges
    MetricSpec("kv_blocks_free", "pdserve_kv_blocks_free", _G, "KV cache blocks free."),
    MetricSpec("kv_blocks_used", "pdserve_kv_blocks_used", _G, "KV cache blocks in use."),
    MetricSpec("requests_running", "pdserve_requests_running", _G, "Requests in the running batch."),
    MetricSpec("requests_waiting", "pdserve_requests_waiting", _G, "Requests waiting to be scheduled."),
    MetricSpec("requests_queued", "pdserve_requests_queued", _G,
               "Prefill: requests in the admission queue, waiting for a decode with enough free KV blocks."),
    MetricSpec("known_decodes", "pdserve_known_decodes", _G,
               "Decodes prefill knows and can route to (compatible, fresh load report)."),
    MetricSpec("prefill_rate", "pdserve_prefill_tokens_per_second", _G,
               "Measured prompt throughput: prefill, of its recent forward passes (marginal, the per-pass fixed "
               "time apart); decode, of the prompts it computed itself."),
    MetricSpec("kv_link_rate", "pdserve_kv_link_bytes_per_second", _G,
               "Prefill: measured KV transfer bandwidth of its recent transfers (marginal, bytes over link-busy "
               "time, the per-transfer fixed time apart)."),
    # SLO classes and the global queue (pdserve.slo); slo_class is a name from spec.slo
    MetricSpec("slo_requests", "pdserve_slo_requests_total", _C,
               "Requests by SLO class and outcome (ok|error|cancelled|rejected: refused at once, early rejection).",
               ("slo_class", "outcome")),
    MetricSpec("slo_attainment", "pdserve_slo_attainment_total", _C,
               "Requests that met or missed their class's targets, by target (ttft|tbt|e2e|all) and result (met|missed).",
               ("slo_class", "target", "result")),
    MetricSpec("slo_queue_time", "pdserve_slo_queue_time_seconds", _H,
               "Arrival of a request to leaving the global queue (a decode allocated), by SLO class.", ("slo_class",)),
    MetricSpec("slo_estimate_error", "pdserve_slo_estimate_error_seconds", _H,
               "|estimate at arrival - actual| of a request's queue time (part=queue) and completion time (part=e2e).",
               ("slo_class", "part")),
    MetricSpec("slo_policy", "pdserve_slo_policy_seconds", _H,
               "Time the queue policy (fifo|edf|qlm) took to place an arriving request in line or to order the waiting "
               "requests.", buckets=FINE_BUCKETS),
    MetricSpec("slo_queued", "pdserve_slo_queued", _G, "Requests waiting in the global queue, by SLO class.",
               ("slo_class",)),
)


ROUTER_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("ttft", "pdserve_time_to_first_token_seconds", _H,
               "Arrival of a request to its first byte relayed back from the prefill (router)."),
    MetricSpec("e2e_latency", "pdserve_e2e_request_latency_seconds", _H,
               "Arrival of a request to the end of its relayed response (router)."),
    MetricSpec("requests", "pdserve_requests_total", _C,
               "Requests the router finished, by outcome (ok|error|cancelled) and reason.", ("outcome", "reason")),
    MetricSpec("router_overhead", "pdserve_router_overhead_seconds", _H,
               "Router: arrival of a request to its prefill chosen (read the body, tokenize, hash, choose).",
               buckets=FINE_BUCKETS),
    MetricSpec("router_decisions", "pdserve_router_decisions_total", _C,
               "Router: requests sent to each prefill, by reason (single|prefix|load|balance|retry).", ("prefill", "reason")),
    MetricSpec("router_prompt_blocks", "pdserve_router_prompt_blocks_total", _C,
               "Router: reusable full blocks of the prompts it routed."),
    MetricSpec("router_prefix_hit_blocks", "pdserve_router_prefix_hit_blocks_total", _C,
               "Router: of those, blocks the index says the chosen prefill already held."),
    MetricSpec("router_index_resyncs", "pdserve_router_index_resyncs_total", _C,
               "Router: snapshots applied to the KV-event index, by prefill and reason (initial|epoch|resync), and "
               "streams distrusted (gap|epoch|unsynced|disconnected).", ("prefill", "reason")),
    MetricSpec("router_index_blocks", "pdserve_router_index_blocks", _G,
               "Router: block hashes the index holds for each prefill.", ("prefill",)),
    MetricSpec("router_routable_prefills", "pdserve_router_routable_prefills", _G,
               "Router: prefills with a fresh, ready load report."),
)


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

    def __init__(self, metric, common: dict[str, str], extra: tuple[str, ...]):
        self._metric, self._common, self._extra = metric, common, extra

    def labels(self, **extra: str):
        if set(extra) != set(self._extra):
            raise ValueError(f"{self._metric._name}: labels must be exactly {self._extra}, got {tuple(extra)}")
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
            setattr(self, spec.attr, _Labelled(metric, common, spec.labels) if spec.labels else metric.labels(**common))
            self._families[spec.attr] = metric
        self._on_scrape: list = []

    def follow_counter(self, attr: str, read) -> None:
        """Keep the counter ``attr`` equal to ``read()`` (a running total kept elsewhere, e.g. by the
        engine), brought up to date at every scrape."""
        counter, last = getattr(self, attr), [0]

        def refresh() -> None:
            now = read()
            if now > last[0]:
                counter.inc(now - last[0])
                last[0] = now
        self._on_scrape.append(refresh)

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
