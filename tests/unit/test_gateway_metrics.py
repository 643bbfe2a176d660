"""The model-server protocol on /metrics (pdserve.metrics.track_load): vLLM's names, as the Gateway API
Inference Extension's endpoint picker reads them, and the pdserve_ gauges, from one reading per scrape.
(Against real servers: tests/e2e/test_gateway_metrics_e2e.py.)"""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.metrics import GATEWAY_METRICS, LOAD_GAUGES, METRICS, EngineLoad, ServerMetrics

# What the endpoint picker reads by default (gateway-api-inference-extension's model-server protocol:
# docs/proposals/003-model-server-protocol; EPP flags --total-queued-requests-metric and friends).
EPP_DEFAULTS = {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                "vllm:cache_config_info"}


def families(m: ServerMetrics) -> dict[str, list]:
    body, _ = m.render()
    return {f.name: f.samples for f in text_string_to_metric_families(body.decode())}


def value(fams: dict, name: str) -> float:
    (sample,) = fams[name]
    return sample.value


def test_the_endpoint_pickers_names_are_exported_as_gauges():
    assert EPP_DEFAULTS <= {g.name for g in GATEWAY_METRICS}
    m = ServerMetrics(role="decode", pool="main", inference_service="chat")
    m.track_load(lambda: EngineLoad(waiting=2, running=3, kv_blocks_total=200, kv_blocks_free=150, block_size=16))
    body = m.render()[0].decode()
    for name in (g.name for g in GATEWAY_METRICS):
        assert f"# TYPE {name} gauge" in body
    fams = families(m)
    assert value(fams, "vllm:num_requests_waiting") == 2 and value(fams, "vllm:num_requests_running") == 3
    assert value(fams, "vllm:kv_cache_usage_perc") == value(fams, "vllm:gpu_cache_usage_perc") == 0.25
    (info,) = fams["vllm:cache_config_info"]
    assert info.value == 1 and info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "200"
    assert (info.labels["pool"] == "main" and info.labels["inference_service"] == "chat"
            and info.labels["role"] == "decode")


def test_one_reading_per_scrape_feeds_the_pdserve_gauges_too():
    reads = []

    def read():
        reads.append(1)
        n = len(reads)
        return EngineLoad(waiting=n, running=10 * n, kv_blocks_total=64, kv_blocks_free=64 - n, block_size=16)

    m = ServerMetrics(role="prefill")
    m.kv_blocks_used.set(99)  # set before tracking: replaced by the reading
    m.track_load(read)
    m.requests_running.set(12345)  # ignored from now on
    fams = families(m)
    assert len(reads) == 1
    assert value(fams, "pdserve_requests_running") == value(fams, "vllm:num_requests_running") == 10
    assert value(fams, "pdserve_requests_waiting") == value(fams, "vllm:num_requests_waiting") == 1
    assert value(fams, "pdserve_kv_blocks_used") == 1 and value(fams, "pdserve_kv_blocks_free") == 63
    fams = families(m)
    assert len(reads) == 2 and value(fams, "pdserve_requests_running") == 20  # read afresh at every scrape
    for spec in METRICS:
        if spec.attr in LOAD_GAUGES:  # each appears once, with the common labels
            (sample,) = fams[spec.name]
            assert set(sample.labels) == {"role", "pool", "inference_service"}


def test_an_empty_cache_reads_zero_not_a_division_error():
    m = ServerMetrics(role="decode")
    m.track_load(lambda: EngineLoad(waiting=0, running=0, kv_blocks_total=0, kv_blocks_free=0, block_size=16))
    assert value(families(m), "vllm:kv_cache_usage_perc") == 0


def test_only_prefill_and_decode_track_a_load_and_only_once():
    load = lambda: EngineLoad(0, 0, 1, 1, 16)  # noqa: E731
    with pytest.raises(ValueError, match="router"):
        ServerMetrics(role="router").track_load(load)
    m = ServerMetrics(role="decode")
    m.track_load(load)
    with pytest.raises(ValueError, match="already"):
        m.track_load(load)
    untracked = families(ServerMetrics(role="decode"))
    assert not {g.name for g in GATEWAY_METRICS} & set(untracked)  # nothing to read: no series
