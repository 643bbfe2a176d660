"""pdserve.metrics: names, labels, the RequestClock and the /metrics exposition."""

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.metrics import (COMMON_LABELS, METRICS, ROUTER_METRICS, MetricSpec, ServerMetrics, exported_series_names)


def scrape(m: ServerMetrics) -> dict[tuple[str, tuple], float]:
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def common(m, **extra):
    labels = {"role": m.role, "pool": m.pool, "inference_service": m.inference_service, **extra}
    return tuple(sorted(labels.items()))


def test_router_metrics_are_their_own_table():
    m = ServerMetrics(role="router")
    assert hasattr(m, "router_decisions") and not hasattr(m, "decode_selections")
    m.router_decisions.labels(prefill="127.0.0.1:1", reason="prefix").inc()
    names = {name for name, _ in scrape(m)}
    assert "pdserve_router_decisions_total" in names and "pdserve_kv_transfer_bytes_total" not in names
    for spec in ROUTER_METRICS:
        assert spec.name.startswith("pdserve_")


def test_names_follow_prometheus_conventions():
    names = [s.name for s in METRICS]
    assert len(names) == len(set(names))
    attrs = [s.attr for s in METRICS]
    assert len(attrs) == len(set(attrs))
    for spec in METRICS:
        assert spec.name.startswith("pdserve_")
        if spec.kind == "counter":
            assert spec.name.endswith("_total")
        if spec.kind == "histogram":
            assert spec.name.endswith("_seconds")
            assert spec.buckets[-1] >= 60 and spec.buckets[0] <= 0.001


def test_bad_specs_and_labels_are_refused():
    with pytest.raises(ValueError, match="_total"):
        MetricSpec("x", "pdserve_x", "counter", "x")
    with pytest.raises(ValueError, match="pdserve_"):
        MetricSpec("x", "x_seconds", "histogram", "x")
    with pytest.raises(ValueError, match="role"):
        ServerMetrics(role="planner")
    with pytest.raises(ValueError, match="pool"):
        ServerMetrics(role="decode", pool="")
    m = ServerMetrics(role="prefill")
    with pytest.raises(ValueError, match="outcome"):
        m.requests.labels(reason="stop").inc()


def test_every_metric_is_exported_with_the_common_labels():
    m = ServerMetrics(role="decode", pool="main", inference_service="chat")
    m.requests.labels(outcome="ok", reason="stop").inc()
    m.decode_selections.labels(decode="127.0.0.1:1").inc()
    m.decode_retries.labels(reason="no_kv_blocks").inc()
    m.local_fallbacks.labels(reason="no_decode").inc()
    m.kv_allocation_refusals.labels(reason="no_kv_blocks").inc()
    m.kv_prompt_blocks.labels(source="reused").inc()
    m.disaggregation_decisions.labels(decision="remote", reason="remote_cheaper").inc()
    m.slo_requests.labels(slo_class="default", outcome="ok").inc()
    m.slo_attainment.labels(slo_class="default", target="ttft", result="met").inc()
    m.slo_queue_time.labels(slo_class="default").observe(0.1)
    m.slo_estimate_error.labels(slo_class="default", part="e2e").observe(0.1)
    m.slo_queued.labels(slo_class="default").set(0)
    m.kv_evictions.labels(action="evict").inc()
    m.api_key_requests.labels(api_key="alice").inc()  # the OpenAI doors' keys (pdserve.http_auth)
    m.api_key_refusals.labels(reason="missing").inc()
    # the KV tier metrics follow the engine's running totals (server_setup.follow_tier_metrics)
    for attr in ("kv_tier_hits", "kv_tier_evictions", "kv_tier_checksum_mismatches", "kv_tier_write_errors"):
        m.follow_counter(attr, lambda: 3, tier="disk")
    m.follow_counter("kv_tier_moved_bytes", lambda: 4096, tier="host", direction="in")
    m.follow_counter("kv_tier_move_time", lambda: 0.25, tier="host", direction="out")
    held = [1024]
    m.follow_gauge("kv_tier_bytes", lambda: held[0], tier="host")
    samples = scrape(m)
    assert samples[("pdserve_kv_tier_hits_total", common(m, tier="disk"))] == 3
    assert samples[("pdserve_kv_tier_move_seconds_total", common(m, tier="host", direction="out"))] == 0.25
    assert samples[("pdserve_kv_tier_bytes", common(m, tier="host"))] == 1024
    held[0] = 0
    assert scrape(m)[("pdserve_kv_tier_bytes", common(m, tier="host"))] == 0  # read again at every scrape
    seen = {name for name, _ in samples}
    assert exported_series_names() <= seen
    for (name, labels) in samples:
        if name.startswith("pdserve_"):
            assert dict(labels)["role"] == "decode"
            assert dict(labels)["pool"] == "main"
            assert dict(labels)["inference_service"] == "chat"
            assert set(COMMON_LABELS) <= set(dict(labels))


def test_values_reach_the_exposition():
    m = ServerMetrics(role="prefill", pool="p", inference_service="svc")
    m.prefill_compute.observe(0.004)
    m.prefill_compute.observe(2.0)
    m.kv_blocks_free.set(17)
    m.kv_transfer_bytes.inc(4096)
    m.requests.labels(outcome="error", reason="no_decode").inc(2)
    s = scrape(m)
    assert s[("pdserve_prefill_compute_seconds_count", common(m))] == 2
    assert s[("pdserve_prefill_compute_seconds_sum", common(m))] == pytest.approx(2.004)
    assert s[("pdserve_prefill_compute_seconds_bucket", common(m, le="0.005"))] == 1
    assert s[("pdserve_kv_blocks_free", common(m))] == 17
    assert s[("pdserve_kv_transfer_bytes_total", common(m))] == 4096
    assert s[("pdserve_requests_total", common(m, outcome="error", reason="no_decode"))] == 2


def test_registries_are_per_instance():
    a = ServerMetrics(role="prefill")
    b = ServerMetrics(role="prefill")
    a.prompt_tokens.inc(5)
    assert scrape(a)[("pdserve_prompt_tokens_total", common(a))] == 5
    assert scrape(b)[("pdserve_prompt_tokens_total", common(b))] == 0


def test_from_env_reads_pool_and_service(monkeypatch):
    monkeypatch.setenv("PDSERVE_POOL", "gpu-a")
    monkeypatch.setenv("PDSERVE_INFERENCE_SERVICE", "chat")
    m = ServerMetrics.from_env("decode")
    assert (m.pool, m.inference_service) == ("gpu-a", "chat")
    assert ServerMetrics.from_env("decode", pool="x").pool == "x"


def test_request_clock_records_ttft_tbt_e2e_once():
    m = ServerMetrics(role="prefill")
    clock = m.request_clock(prompt_tokens=12)
    clock.token()
    clock.token(3)  # three tokens in one chunk: three gaps
    clock.token()
    clock.finish("ok", "length")
    clock.finish("error", "late")  # ignored
    s = scrape(m)
    assert s[("pdserve_time_to_first_token_seconds_count", common(m))] == 1
    assert s[("pdserve_time_between_tokens_seconds_count", common(m))] == 4
    assert s[("pdserve_e2e_request_latency_seconds_count", common(m))] == 1
    assert s[("pdserve_generation_tokens_total", common(m))] == 5
    assert s[("pdserve_prompt_tokens_total", common(m))] == 12
    assert s[("pdserve_requests_total", common(m, outcome="ok", reason="length"))] == 1
    assert ("pdserve_requests_total", common(m, outcome="error", reason="late")) not in s
    with pytest.raises(ValueError):
        m.request_clock().finish("maybe")
    with pytest.raises(ValueError):
        m.request_clock().token(0)


def test_aiohttp_handler_serves_the_exposition():
    from aiohttp.test_utils import make_mocked_request

    m = ServerMetrics(role="decode")
    m.requests_running.set(3)
    resp = asyncio.run(m.aiohttp_handler(make_mocked_request("GET", "/metrics")))
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain")
    assert b'pdserve_requests_running{inference_service="local",pool="default",role="decode"} 3.0' in resp.body
