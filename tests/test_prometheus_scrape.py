"""A real Prometheus (Debian package `prometheus`, installed by `make prometheus-bin`) scrapes
pdserve's /metrics exposition and answers queries over it.

Also home of ``PrometheusServer``, the runner the dashboard test reuses: it starts the binary
itself (never the system service) with its own config and data directory on a free port on
127.0.0.1, and stops it when the test ends.
"""

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from pdserve.metrics import ServerMetrics
from procs import free_port
from threaded_app import ThreadedApp

pytestmark = pytest.mark.prometheus


class PrometheusServer:
    """`prometheus` on 127.0.0.1:<free port> scraping static targets every `interval` seconds.

    targets: list of (job, "host:port", extra_labels). Use as a context manager.
    """

    def __init__(self, workdir: Path, targets: list[tuple[str, str, dict]], interval: float = 1.0):
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("the prometheus binary is missing: run `make prometheus-bin` (tools/install_prometheus.sh)")
        self.binary, self.workdir, self.port = binary, Path(workdir), free_port()
        self.workdir.mkdir(parents=True, exist_ok=True)
        every = f"{int(interval * 1000)}ms"
        config = {"global": {"scrape_interval": every, "evaluation_interval": every},
                  "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [target], "labels": labels}]}
                                     for job, target, labels in targets]}
        (self.workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "PrometheusServer":
        self.log = open(self.workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}: {self.logs()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready within 60s: {self.logs()[-2000:]}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()

    def logs(self) -> str:
        return (self.workdir / "prometheus.log").read_text(errors="replace")

    def api(self, path: str, **params) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?" + urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                doc = json.load(r)
        except urllib.error.HTTPError as e:  # 400 for a bad query: show Prometheus's message
            doc = json.load(e)
        if doc.get("status") != "success":
            raise AssertionError(f"prometheus {path} {params}: {doc.get('errorType')}: {doc.get('error')}")
        return doc["data"]

    def query(self, expr: str) -> list:
        return self.api("query", query=expr)["result"]

    def query_range(self, expr: str, seconds: float, step: float = 1.0) -> list:
        end = time.time()
        return self.api("query_range", query=expr, start=end - seconds, end=end, step=step)["result"]

    def wait_for_targets_up(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        active = []
        while time.monotonic() < deadline:
            active = self.api("targets")["activeTargets"]
            if len(active) >= n and all(t["health"] == "up" for t in active):
                return
            time.sleep(0.5)
        raise AssertionError(f"targets not all up: {[(t['scrapeUrl'], t['health'], t['lastError']) for t in active]}")


class MetricsApp(ThreadedApp):
    """A ServerMetrics served on /metrics by aiohttp in a background thread (this test only)."""

    def __init__(self, metrics: ServerMetrics):
        from aiohttp import web

        self.metrics = metrics
        app = web.Application()
        app.router.add_get("/metrics", metrics.aiohttp_handler)
        super().__init__(app)


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
        time.sleep(3)  # two scrapes at least
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
