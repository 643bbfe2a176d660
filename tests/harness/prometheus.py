"""``PrometheusServer``: the real Prometheus binary (Debian package `prometheus`, installed by
`make prometheus-bin`) started by a test itself, never the system service, with its own config and
data directory on a free port on 127.0.0.1; stopped when the `with` block ends.

A test that changes what a server exports waits for Prometheus to have scraped it since, instead of
sleeping a few intervals:

    since = time.time()                       # after the change
    prom.wait_for_scrapes(1, since)           # every target scraped at least once after it
"""

import json
import math
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from pdserve.net import free_port

SCRAPE_STAMP_SLACK_S = 0.05
SCRAPES_HANG_GUARD_S = 30.0  # the least wait_for_scrapes allows before it calls Prometheus stuck


class PrometheusServer:
    """`prometheus` on 127.0.0.1:<free port> scraping static targets every `interval` seconds.

    targets: list of (job, "host:port", extra_labels); port: where it listens (default: a free port,
    chosen here; pass one when something must know the URL before it starts). Use as a context manager.
    """

    def __init__(self, workdir: Path, targets: list[tuple[str, str, dict]], interval: float = 1.0,
                 port: int | None = None):
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("the prometheus binary is missing: run `make prometheus-bin` (tools/install_prometheus.sh)")
        self.binary, self.workdir, self.port = binary, Path(workdir), port or free_port()
        self.targets, self.interval = targets, interval
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
                pass
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

    def scrapes_since(self, since: float) -> dict[str, int]:
        """target ("host:port") -> how many scrapes of it started after `since` (a time.time()): its `up` samples, each
        stamped with its scrape's start. A scrape counts only when it started SCRAPE_STAMP_SLACK_S
        after `since`, because Prometheus may move a scrape's stamp by up to 2 ms (timestamp alignment)."""
        window = math.ceil(time.time() - since) + 2
        after = since + SCRAPE_STAMP_SLACK_S
        return {series["metric"]["instance"]: sum(float(stamp) > after for stamp, _ in series["values"])
                for series in self.query(f"up[{window}s]")}

    def wait_for_scrapes(self, n: int, since: float, timeout: float | None = None) -> None:
        """Until every target has been scraped at least `n` times since `since` (a time.time() taken
        after the change the test wants to see): then every series holds a value read after it.
        timeout: a hang guard only, by default 10x the expected wait (n + 1 intervals), at least
        SCRAPES_HANG_GUARD_S."""
        timeout = timeout or max(SCRAPES_HANG_GUARD_S, 10 * (n + 1) * self.interval)
        targets = {target for _, target, _ in self.targets}
        deadline = time.monotonic() + timeout
        while True:
            counts = self.scrapes_since(since)
            if all(counts.get(target, 0) >= n for target in targets):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"hang guard: not every target scraped {n} times within {timeout:.0f}s "
                                     f"after the change: {counts}")
            time.sleep(self.interval / 5)

    def wait_for_targets_up(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        active = []
        while time.monotonic() < deadline:
            active = self.api("targets")["activeTargets"]
            if len(active) >= n and all(t["health"] == "up" for t in active):
                return
            time.sleep(0.5)
        raise AssertionError(f"targets not all up: {[(t['scrapeUrl'], t['health'], t['lastError']) for t in active]}")


class RecordedExporter:
    """Serves a recorded exposition-format text (e.g. dcgm-exporter's /metrics, tests/prometheus/fixtures) at
    http://127.0.0.1:<free port>/metrics for Prometheus to scrape, as that exporter would; a context manager.
    ``target`` is the "host:port" to give PrometheusServer."""

    def __init__(self, text: str):
        import http.server

        body = text.encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the http.server interface
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # quiet: Prometheus scrapes every interval
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.target = f"127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "RecordedExporter":
        import threading

        self.thread = threading.Thread(target=self.server.serve_forever, name="recorded-exporter", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
