"""A real Prometheus (Debian package `prometheus`, installed by `make prometheus-bin`; run by
tests/harness/prometheus.py) scrapes pdserve's /metrics exposition and answers queries over it."""

import time

import pytest

from pdserve.metrics import ServerMetrics
from harness.prometheus import PrometheusServer
from harness.threaded_app import MetricsApp

pytestmark = pytest.mark.prometheus


def test_prometheus_scrapes_and_queries_server_metrics(tmp_path):
    m = ServerMetrics(role="prefill", pool="p0", inference_service="chat")
    with MetricsApp(m) as app, PrometheusServer(tmp_path / "prom", [("prefill", f"127.0.0.1:{app.port}",
                                                                     {"namespace": "ns1"})]) as prom:
        prom.wait_for_targets_up(1)
        for i in range(40):
            clock = m.request_clock(prompt_tokens=10)
            clock.token()
            clock.token(4)
            clock.finish("ok", "length")
            m.kv_transfer_layer.observe(0.002 * (i % 5 + 1))
        m.kv_blocks_free.set(123)
        prom.wait_for_scrapes(1, since=time.time())  # a scrape that started after the last change
        sel = '{namespace="ns1", inference_service="chat", role="prefill", pool="p0"}'
        r = prom.query(f"pdserve_kv_blocks_free{sel}")
        assert [float(x["value"][1]) for x in r] == [123.0]
        r = prom.query(f"pdserve_generation_tokens_total{sel}")
        assert float(r[0]["value"][1]) == 200.0
        r = prom.query(f"sum(pdserve_requests_total{{{sel[1:-1]}, outcome=\"ok\", reason=\"length\"}})")
        assert float(r[0]["value"][1]) == 40.0
        r = prom.query(f"histogram_quantile(0.5, sum by (le) (pdserve_kv_transfer_layer_seconds_bucket{sel}))")
        median = float(r[0]["value"][1])
        assert 0.001 <= median <= 0.01
        names = set(prom.api("label/__name__/values"))
        assert "pdserve_time_to_first_token_seconds_bucket" in names
