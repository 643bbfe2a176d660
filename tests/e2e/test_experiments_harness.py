"""The experiment harness's own parts: shaped namespace links (real `ip netns` + `tc`),
bench models, /metrics scraping, arguments. The experiments themselves are benchmarks
(`pdserve bench experiment ...`), not tests."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.bench.experiments.launcher import BENCH_MODELS, Launcher, bench_model, metric_sum, scrape
from pdserve.bench.experiments.netns import LinkedNamespaces
from pdserve.metrics import ServerMetrics
from harness.conditions import wait_until
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
print(n, n / (time.perf_counter() - t0))
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


def _qdisc(ns: str) -> str:
    """`tc -s qdisc show` inside a namespace: each qdisc, its settings and its counters."""
    return subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show"], capture_output=True, text=True,
                          check=True).stdout


def _tbf_counters(text: str) -> tuple[int, int]:
    """(bytes sent, overlimits) of the token bucket filter in `tc -s qdisc show` output."""
    tbf = text[text.index("qdisc tbf"):]
    sent = re.search(r"Sent (\d+) bytes \d+ pkt \(dropped \d+, overlimits (\d+)", tbf)
    return int(sent.group(1)), int(sent.group(2))


@needs_root
def test_linked_namespaces_shape_the_link_and_clean_up():
    """The shaping is a mechanism, checked as one: a token bucket filter at the link's rate on both
    ends, that the traffic went through and that held packets back (overlimits), and all the bytes
    arrive. No window on the measured speed (it moved with the box's load); only a wide bound that
    says the link is shaped at all (an unshaped veth runs hundreds of times faster)."""
    link = LinkedNamespaces(40, prefix="pdtst", subnet=211)
    with link:
        assert link.exists()
        for ns in (link.prefill_ns, link.decode_ns):
            assert re.search(r"qdisc tbf [^\n]* root [^\n]* rate 40Mbit ", _qdisc(ns)), _qdisc(ns)
        recv = subprocess.Popen(["ip", "netns", "exec", link.decode_ns, sys.executable, "-c", RECEIVER, link.decode_ip],
                                stdout=subprocess.PIPE, text=True)
        # 64 KiB x 48 = 3 MiB: well past the filter's 32 KiB burst, so it must hold packets back
        subprocess.run(["ip", "netns", "exec", link.prefill_ns, sys.executable, "-c", SENDER, link.decode_ip, "48"],
                       check=True, timeout=60)
        received, bytes_per_s = recv.communicate(timeout=60)[0].split()
        assert int(received) == 48 << 16  # a working link: every byte arrived
        sent, overlimits = _tbf_counters(_qdisc(link.prefill_ns))
        assert sent >= 48 << 16 and overlimits > 0, (sent, overlimits)  # through the filter, which throttled it
        assert float(bytes_per_s) < 3 * 40e6 / 8, bytes_per_s  # shaped at all
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
        # pinned: taskset set the affinity, then became the child itself (python, still running)
        program = lambda: Path(f"/proc/{sleeper.popen.pid}/cmdline").read_bytes().split(b"\0")[0]  # noqa: E731
        wait_until(lambda: program() == sys.executable.encode(), "taskset to exec the child")
        assert os.sched_getaffinity(sleeper.popen.pid) == {0}
        assert sleeper.popen.poll() is None
    # stopped by SIGTERM (python's default action: it dies of it), not SIGKILL after the 15 s grace
    assert sleeper.popen.poll() == -signal.SIGTERM


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
