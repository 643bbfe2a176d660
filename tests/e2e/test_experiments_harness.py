"""The experiment harness's own parts: shaped namespace links (real `ip netns` + `tc`),
bench models, /metrics scraping, arguments. The experiments themselves are benchmarks
(`pdserve bench experiment ...`), not tests."""

import os
import subprocess
import sys
import time

import pytest

from pdserve.bench.experiments.launcher import BENCH_MODELS, Launcher, bench_model, metric_sum, scrape
from pdserve.bench.experiments.netns import LinkedNamespaces
from pdserve.metrics import ServerMetrics
from harness.procs import VENV_BIN

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")

RECEIVER = """
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 5601)); s.listen(1)
c, _ = s.accept(); n = 0; t0 = None
while True:
    d = c.recv(1 << 20)
    if not d: break
    if t0 is None: t0 = time.perf_counter()
    n += len(d)
print(n / (time.perf_counter() - t0))
"""
SENDER = """
import socket, sys, time
for _ in range(50):
    try: s = socket.create_connection((sys.argv[1], 5601)); break
    except OSError: time.sleep(0.1)
b = b"x" * (1 << 16)
for _ in range(int(sys.argv[2])): s.sendall(b)
s.close()
"""


@needs_root
def test_linked_namespaces_shape_the_link_and_clean_up():
    link = LinkedNamespaces(40, prefix="pdtst", subnet=211)
    with link:
        assert link.exists()
        recv = subprocess.Popen(["ip", "netns", "exec", link.decode_ns, sys.executable, "-c", RECEIVER, link.decode_ip],
                                stdout=subprocess.PIPE, text=True)
        # 64 KiB x 48 = 3 MiB: ~0.63 s at 40 Mbit/s
        subprocess.run(["ip", "netns", "exec", link.prefill_ns, sys.executable, "-c", SENDER, link.decode_ip, "48"],
                       check=True, timeout=60)
        bytes_per_s = float(recv.communicate(timeout=60)[0])
        assert bytes_per_s < 1.3 * 40e6 / 8, bytes_per_s  # shaped
        assert bytes_per_s > 0.5 * 40e6 / 8, bytes_per_s  # and still a working link
        # the root namespace cannot reach the decode side: the link is private
        out = subprocess.run(["ip", "route", "get", link.decode_ip], capture_output=True, text=True)
        assert "dev pdtst" not in out.stdout
    assert not link.exists()


@needs_root
def test_namespaces_are_removed_when_the_body_fails():
    link = LinkedNamespaces(100, prefix="pdtsf", subnet=212)
    with pytest.raises(RuntimeError, match="boom"):
        with link:
            assert link.exists()
            raise RuntimeError("boom")
    assert not link.exists()
    with pytest.raises(ValueError, match="rate"):
        LinkedNamespaces(0)


def test_bench_model_loads_in_the_engine(tmp_path):
    from pdserve.engine.loader import load_model

    assert bench_model(tmp_path, "tiny") == "tiny"
    path = bench_model(tmp_path, "wire", max_len=4096)
    loaded = load_model(path)
    hidden, inter, layers, heads, kv_heads, head_dim = BENCH_MODELS["wire"]
    cfg = loaded.config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (hidden, layers, kv_heads, head_dim)
    assert cfg.max_position_embeddings == 4096
    assert bench_model(tmp_path, "wire") == path  # written once
    with pytest.raises(ValueError, match="model size"):
        bench_model(tmp_path, "huge")


def test_scrape_and_metric_sum(tmp_path):
    from harness.threaded_app import MetricsApp

    m = ServerMetrics(role="decode", pool="a")
    m.kv_allocation_refusals.labels(reason="no_kv_blocks").inc(3)
    m.kv_allocation_refusals.labels(reason="draining").inc(1)
    with MetricsApp(m) as app:
        samples = scrape(f"http://127.0.0.1:{app.port}/metrics")
    assert metric_sum(samples, "pdserve_kv_allocation_refusals_total") == 4
    assert metric_sum(samples, "pdserve_kv_allocation_refusals_total", reason="draining") == 1
    assert metric_sum(samples, "pdserve_kv_allocation_refusals_total", reason="other") == 0


def test_launcher_stops_what_it_started(tmp_path):
    with Launcher(tmp_path) as launcher:
        proc = launcher.start("help", ["bench", "serving", "--help"])
        proc.popen.wait(timeout=60)
        assert "pdserve bench serving" in proc.log.read_text()
        launcher.pdserve = sys.executable  # a long-running child instead of a server
        sleeper = launcher.start("sleeper", ["-c", "import time; time.sleep(300)"], cpus="0")
        time.sleep(0.3)
        assert sleeper.popen.poll() is None
        t = time.monotonic()
    assert sleeper.popen.poll() is not None
    assert time.monotonic() - t < 10  # SIGTERM, not the grace timeout


def test_experiment_cli_lists_and_explains():
    out = subprocess.run([str(VENV_BIN / "pdserve"), "bench", "experiment", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for name in ("isolation", "overlap", "routing", "transmission"):
        assert name in out.stdout
    out = subprocess.run([str(VENV_BIN / "pdserve"), "bench", "experiment", "transmission", "--help"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "--rates-mbit" in out.stdout and "FIFO" in out.stdout
    out = subprocess.run([str(VENV_BIN / "pdserve"), "bench", "experiment", "teleport"], capture_output=True, text=True)
    assert out.returncode != 0 and "invalid choice" in out.stderr
