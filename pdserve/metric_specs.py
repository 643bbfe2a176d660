"""The one table of pdserve's Prometheus metrics: every server metric (``METRICS``) and the
router's (``ROUTER_METRICS``), with their kinds, help texts, extra labels and buckets, and
the rules every name follows (``MetricSpec``). ``pdserve/metrics.py`` builds them
(``ServerMetrics``) and re-exports these names; its docstring says when each is recorded."""

from __future__ import annotations

from dataclasses import dataclass

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
    MetricSpec("engine_busy", "pdserve_engine_busy_seconds_total", _C,
               "Seconds the engine spent running steps (one engine thread: steps never overlap, so its rate is the "
               "engine's utilisation, at most 1; a step in progress counts up to the scrape)."),
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
    MetricSpec("kv_evictions", "pdserve_kv_evictions_total", _C,
               "Decode: batch requests whose KV went to host memory so an interactive request meets its TBT "
               "(action=evict), and came back (action=restore).", ("action",)),
    # prefix-cache tiers below the KV pool (engine/kv_tiers.py); tier = host | disk, direction = in | out
    MetricSpec("kv_tier_hits", "pdserve_kv_tier_hits_total", _C,
               "Prefix-cache blocks copied back into the KV pool from a lower tier instead of computed.", ("tier",)),
    MetricSpec("kv_tier_moved_bytes", "pdserve_kv_tier_moved_bytes_total", _C,
               "KV bytes moved into a tier (in: evicted from the pool or the tier above) or out of it (out: back "
               "into the pool, or down).", ("tier", "direction")),
    MetricSpec("kv_tier_move_time", "pdserve_kv_tier_move_seconds_total", _C,
               "Seconds the engine thread spent moving KV blocks into or out of a tier (copies, disk writes/reads).",
               ("tier", "direction")),
    MetricSpec("kv_tier_evictions", "pdserve_kv_tier_evictions_total", _C,
               "Blocks a tier pushed out over its byte budget (host: down to disk, or dropped; disk: deleted).",
               ("tier",)),
    MetricSpec("kv_tier_checksum_mismatches", "pdserve_kv_tier_checksum_mismatches_total", _C,
               "Tier blocks that failed their checksum on the way back (each a miss: the tokens are computed).",
               ("tier",)),
    MetricSpec("kv_tier_write_errors", "pdserve_kv_tier_write_errors_total", _C,
               "Blocks a tier dropped because it could not store them (disk full, directory gone).", ("tier",)),
    # the KV pool inside a decode (pdserve decode --kv-pool; kvpool/decode_pool.py)
    MetricSpec("kv_pool_pooled_requests", "pdserve_kv_pool_pooled_requests_total", _C,
               "Decode: requests served through the KV pool (too big for its free blocks: part of their KV "
               "borrowed from peer decodes)."),
    MetricSpec("kv_pool_borrowed_blocks", "pdserve_kv_pool_borrowed_blocks_total", _C,
               "Decode: KV blocks its pooled requests borrowed from peer decodes."),
    # gauges
    MetricSpec("kv_pool_lent_blocks", "pdserve_kv_pool_lent_blocks", _G,
               "Decode: KV blocks of its pool lent to peer decodes' requests now."),
    MetricSpec("kv_tier_bytes", "pdserve_kv_tier_bytes", _G, "KV bytes a prefix-cache tier holds now.", ("tier",)),
    MetricSpec("kv_blocks_free", "pdserve_kv_blocks_free", _G, "KV cache blocks free."),
    MetricSpec("kv_swapped_requests", "pdserve_kv_swapped_requests", _G,
               "Decode: requests evicted to host memory now (out of the running batch until restored)."),
    MetricSpec("kv_swapped_bytes", "pdserve_kv_swapped_bytes", _G, "Decode: bytes of KV evicted to host memory now."),
    MetricSpec("kv_blocks_used", "pdserve_kv_blocks_used", _G, "KV cache blocks in use."),
    MetricSpec("requests_running", "pdserve_requests_running", _G, "Requests in the running batch."),
    MetricSpec("requests_waiting", "pdserve_requests_waiting", _G, "Requests waiting to be scheduled."),
    MetricSpec("requests_queued", "pdserve_requests_queued", _G,
               "Prefill: requests in the admission queue, waiting for a decode with enough free KV blocks "
               "(with --queue-policy edf or qlm, also for room in the prefill engine's line)."),
    MetricSpec("known_decodes", "pdserve_known_decodes", _G,
               "Decodes prefill knows and can route to (compatible, fresh load report)."),
    MetricSpec("prefill_rate", "pdserve_prefill_tokens_per_second", _G,
               "Measured prompt throughput: prefill, of its recent forward passes (marginal, the per-pass fixed "
               "time apart); decode, of the prompts it computed itself."),
    MetricSpec("kv_link_rate", "pdserve_kv_link_bytes_per_second", _G,
               "Prefill: measured KV transfer bandwidth of its recent transfers (marginal, bytes over link-busy "
               "time, the per-transfer fixed time apart)."),
)

# SLO classes and the global queue (pdserve.slo), in every front door (the prefill, the router);
# slo_class is a name from spec.slo
SLO_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("slo_requests", "pdserve_slo_requests_total", _C,
               "Requests by SLO class and outcome (ok|error|cancelled|rejected: refused at once, early rejection).",
               ("slo_class", "outcome")),
    MetricSpec("slo_attainment", "pdserve_slo_attainment_total", _C,
               "Requests that met or missed their class's targets, by target "
               "(ttft|tbt|e2e|all) and result (met|missed).",
               ("slo_class", "target", "result")),
    MetricSpec("slo_queue_time", "pdserve_slo_queue_time_seconds", _H,
               "Arrival of a request to leaving the global queue (prefill: a decode allocated; router: sent on to a "
               "prefill), by SLO class.", ("slo_class",)),
    MetricSpec("slo_estimate_error", "pdserve_slo_estimate_error_seconds", _H,
               "|estimate at arrival - actual| of a request's queue time (part=queue) and completion time (part=e2e).",
               ("slo_class", "part")),
    MetricSpec("slo_policy", "pdserve_slo_policy_seconds", _H,
               "Time the queue policy (fifo|edf|qlm) took to place an arriving request in line or to order the waiting "
               "requests.", buckets=FINE_BUCKETS),
    MetricSpec("slo_queued", "pdserve_slo_queued", _G, "Requests waiting in the global queue, by SLO class.",
               ("slo_class",)),
)
# The server process itself (pdserve/gc_pauses.py), in every role
PROCESS_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("gc_full_collection", "pdserve_gc_full_collection_seconds", _H,
               "Full (generation 2) garbage collections of the server process, each one's duration: every thread "
               "waits meanwhile (a token gap that long).", buckets=FINE_BUCKETS),
)
# API keys at the OpenAI doors (pdserve/http_auth.py), in the prefill and the router: a key's name
# (api_keys.py), never the key
AUTH_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("api_key_requests", "pdserve_api_key_requests_total", _C,
               "Requests let in by each API key, by the key's name (name:key in the key file, else key- and 8 hex "
               "digits of its SHA-256).", ("api_key",)),
    MetricSpec("api_key_refusals", "pdserve_api_key_refusals_total", _C,
               "Requests refused with 401 at the door, by reason (missing: no Bearer key; invalid: not a known key).",
               ("reason",)),
)
METRICS = METRICS + SLO_METRICS + PROCESS_METRICS + AUTH_METRICS


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
    MetricSpec("router_residence", "pdserve_router_residence_seconds", _H,
               "Router: its own time on a request's way to the first byte, once per request relayed over HTTP: "
               "the request seen -> its body written to the prefill, plus the first answer's bytes read from the "
               "prefill -> written to the client (router/residence.py); the prefill's time is not in it.",
               buckets=FINE_BUCKETS),
    MetricSpec("router_decisions", "pdserve_router_decisions_total", _C,
               "Router: requests sent to each prefill, by reason (single|prefix|load|balance|retry|resume: a "
               "stream continued there after its prefill broke).", ("prefill", "reason")),
    MetricSpec("router_resumes", "pdserve_router_resumes_total", _C,
               "Router: streams whose prefill broke after the client got part of them and that could be resumed, by "
               "outcome (resumed: other prefills finished them | failed: the client got an error event).",
               ("outcome",)),
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
    # SLO_METRICS: its queue (router/slo_gate.py), with SLO classes declared; AUTH_METRICS: its door's API keys
) + SLO_METRICS + PROCESS_METRICS + AUTH_METRICS
