"""The operator's autoscaling parts that need no cluster: settings from the InferenceService, the
deletion-cost ranking, the PromQL and its answers -> Window, and the pods' own /metrics as a source."""

import copy
from pathlib import Path

import pytest
import yaml

from pdserve.metrics import EngineLoad, ServerMetrics
from pdserve.operator.autoscaling import planner_config, rank_for_deletion
from pdserve.operator.autoscaling_metrics import PodsSource, PoolRef
from pdserve.planner.promql import pod_load_query, window_from_values, window_queries

REPO = Path(__file__).resolve().parents[2]


def example(**autoscaling) -> dict:
    doc = yaml.safe_load((REPO / "examples" / "inferenceservice.yaml").read_text())
    doc["spec"]["autoscaling"] = autoscaling
    return doc


def test_settings_come_from_the_slo_and_spec_autoscaling():
    isvc = example(enabled=True, decode={"minReplicas": 2, "maxReplicas": 6}, scaleDownStabilizationSeconds=120,
                   cooldownSeconds=30)
    isvc["spec"]["slo"] = {"ttftMs": 500, "tbtMs": 40}
    cfg = planner_config(isvc)
    assert (cfg.decode.min_replicas, cfg.decode.max_replicas) == (2, 6)
    assert (cfg.prefill.min_replicas, cfg.prefill.max_replicas) == (1, 4)   # the schema's defaults
    assert cfg.ttft_target_s == 0.5 and cfg.tbt_target_s == 0.04
    assert cfg.down_stabilisation_s == 120 and cfg.cooldown_s == 30
    bad = copy.deepcopy(isvc)
    bad["spec"]["autoscaling"]["decode"] = {"minReplicas": 5, "maxReplicas": 2}
    with pytest.raises(ValueError, match="max_replicas"):
        planner_config(bad)


def test_the_least_loaded_pod_gets_the_lowest_deletion_cost():
    costs = rank_for_deletion({"a": 3, "b": 0.0, "c": 1}, ["a", "b", "c", "d"])
    assert costs == {"b": 0, "d": 1, "c": 2, "a": 3}        # d has no reading: idle, after b by name


def test_promql_selects_one_service_and_pool_and_escapes_values():
    q = window_queries({"inference_service": 'chat"x', "namespace": "ns"}, 30, 0.9, decode_pool="main")
    assert 'inference_service="chat\\"x"' in q["ttft"] and 'role="prefill"' in q["ttft"] and "[30s]" in q["ttft"]
    assert 'pool="main"' in q["kv_used"] and 'role="decode"' in q["kv_used"] and "avg_over_time" in q["kv_used"]
    assert "pool" not in window_queries({"inference_service": "c"}, 30)["kv_used"]
    assert q["prefill_busy"].startswith("sum(rate(pdserve_engine_busy_seconds_total{") and 'role="prefill"' in q[
        "prefill_busy"]
    assert "sum by (pod)" in pod_load_query({"inference_service": "c"}, "decode", "main")
    with pytest.raises(ValueError, match="label name"):
        window_queries({"bad-label": "x"}, 30)
    with pytest.raises(ValueError, match="window_s"):
        window_queries({"inference_service": "c"}, 0.5)


def test_answers_become_a_window_and_missing_ones_mean_nothing_observed():
    values = {"ttft": 0.8, "tbt": float("nan"), "requests": 40.0, "prefill_busy": 0.9, "prefill_waiting": 3.0,
              "prefill_waiting_delta": 6.0, "kv_used": 30.0, "kv_free": 70.0, "decode_running": 4.0,
              "generation_tokens": 120.0}
    w = window_from_values(values, 30.0, 1000.0, prefill_ready=3, decode_ready=2)
    assert w.ttft_s == 0.8 and w.tbt_s is None and w.requests == 40
    assert w.prefill.busy == pytest.approx(0.3) and w.prefill.waiting == 3 and w.prefill.waiting_growth_per_s == 0.2
    assert w.decode.kv_utilisation == pytest.approx(0.3) and w.decode.running == 4 and w.decode.replicas == 2
    empty = window_from_values({}, 30.0, 1000.0, prefill_ready=1, decode_ready=1)
    assert empty.decode.kv_utilisation is None and empty.notes and empty.ttft_s is None


def test_the_pods_own_metrics_make_a_window_per_pool():
    metrics = {"p0": ServerMetrics("prefill"), "d0": ServerMetrics("decode"), "d1": ServerMetrics("decode")}
    ips = {"p0": "10.0.0.1", "d0": "10.0.0.2", "d1": "10.0.0.3"}
    by_ip = {ip: metrics[pod] for pod, ip in ips.items()}
    source = PodsSource(fetch=lambda url: by_ip[url.split("//")[1].split(":")[0]].render()[0].decode())
    pools = [PoolRef("chat-prefill", "prefill", "prefill", {"p0": ips["p0"]}),
             PoolRef("chat-decode-main", "decode", "main", {"d0": ips["d0"]}),
             PoolRef("chat-decode-big", "decode", "big", {"d1": ips["d1"]})]
    for name, used in (("d0", 90), ("d1", 10)):
        metrics[name].track_load(lambda used=used: EngineLoad(waiting=0, running=used // 10, kv_blocks_total=100,
                                                              kv_blocks_free=100 - used, block_size=64))
    assert source.windows("ns", "chat", pools, 10.0, 0.9, now=0.0) == {}     # not a whole window yet
    windows = source.windows("ns", "chat", pools, 10.0, 0.9, now=10.0)
    assert windows["chat-decode-main"].decode.kv_utilisation == pytest.approx(0.9)
    assert windows["chat-decode-big"].decode.kv_utilisation == pytest.approx(0.1)
    assert windows["chat-prefill"].decode.kv_utilisation == pytest.approx(0.5)   # prefill's view: every decode
    assert windows["chat-prefill"].prefill.replicas == 1
    assert source.pod_loads("ns", "chat", pools[1]) == {"d0": 9.0}
