"""`pdserve bench conformance` against real processes: a `pdserve up --prefill 1 --decode 1` cluster (P/D)
checked against a colocated pdserve (`pdserve up --decode 0 --local-fallback`) as the reference passes
every check; and a fault run that SIGKILLs the decode (its pid from `pdserve up --log-dir`'s decode-0.pid)
under streaming load: no stream hangs, ends silently or comes back with wrong text, and the cluster serves
again. Timings are never asserted: the suite's own hang guards bound every wait.

The decodes' steps last >= DECODE_STEP_FLOOR_S (a test hook `pdserve up` passes on to them), so the
fault run's streams of FAULT_MAX_TOKENS tokens are still running when the kill lands, however fast the CPU."""

import json
import subprocess

import pytest

from harness.conditions import wait_until
from harness.procs import VENV_BIN, ProcessGroup
from pdserve.net import free_ports
from pdserve.test_hooks import DECODE_STEP_FLOOR_ENV

pytestmark = pytest.mark.slow

DECODE_STEP_FLOOR_S = 0.005
FAULT_MAX_TOKENS = 800          # >= 4 s per stream at the step floor; the tiny model's context is 2048
UP_HANG_GUARD_S = 300.0         # only a hang guard: `pdserve up` printing its banner on a loaded box
SUITE_TIMEOUT_S = 900           # only a hang guard: the suite bounds each of its requests itself
SKIPPED_HERE = {"faults.*": "no --kill-cmd"}


class Up:
    """One `pdserve up` child: its URL and log dir, once it printed its banner."""

    def __init__(self, procs: ProcessGroup, tmp, name: str, *flags: str, env: dict | None = None):
        port, grpc_port = free_ports(2)
        self.log_dir, self.url = tmp / f"{name}-logs", f"http://127.0.0.1:{port}"
        self.proc = procs.start([str(VENV_BIN / "pdserve"), "up", "--model", "tiny", "--port", str(port),
                                 "--grpc-port", str(grpc_port), "--log-dir", str(self.log_dir), *flags], name=name,
                                env=env)
        self.log = procs.log_dir / f"{name}.log"

    def wait_up(self) -> None:
        def up() -> bool:
            assert self.proc.poll() is None, self.log.read_text(errors="replace")[-3000:]
            return "pdserve is up" in self.log.read_text(errors="replace")
        wait_until(up, f"pdserve up ({self.log_dir.name}) printed its banner", UP_HANG_GUARD_S, pause_s=0.3)

    def server(self, name: str) -> dict:
        return json.loads((self.log_dir / "servers.json").read_text())[name]


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("conformance")
    procs = ProcessGroup(log_dir=tmp / "logs")
    try:
        pd = Up(procs, tmp, "pd", "--prefill", "1", "--decode", "1",
                env={DECODE_STEP_FLOOR_ENV: str(DECODE_STEP_FLOOR_S)})
        colocated = Up(procs, tmp, "colocated", "--prefill", "1", "--decode", "0", "--local-fallback")
        pd.wait_up()
        colocated.wait_up()
        yield pd, colocated, tmp
    finally:
        procs.close()


def conformance(tmp, name: str, *argv: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp / f"{name}.json"
    proc = subprocess.run([str(VENV_BIN / "pdserve"), "bench", "conformance", "--json", str(out), *argv],
                          capture_output=True, text=True, timeout=SUITE_TIMEOUT_S)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def test_pd_cluster_passes_every_check_against_a_colocated_reference(clusters):
    pd, colocated, tmp = clusters
    decode_metrics = pd.server("decode-0")["ready_url"].removesuffix("/ready") + "/metrics"
    proc, doc = conformance(tmp, "pd", "--url", pd.url, "--reference-url", colocated.url,
                            "--metrics-url", pd.url + "/metrics", "--metrics-url", decode_metrics)
    verdicts = {c["name"]: c["verdict"] for c in doc["checks"]}
    failed = {c["name"]: c["detail"] for c in doc["checks"] if c["verdict"] == "FAIL"}
    assert not failed and proc.returncode == 0, (failed, proc.stdout[-4000:])
    skipped = set(SKIPPED_HERE)
    try:
        import openai  # noqa: F401 - the client area runs only where the package is
    except ImportError:
        skipped |= {"client.completions", "client.chat-stream", "client.error"}
    assert {n for n, v in verdicts.items() if v == "SKIP"} == skipped, verdicts
    for area in ("correctness", "client", "bad-input", "cancellation"):
        assert any(c["area"] == area and c["verdict"] == "PASS" for c in doc["checks"]), area
    for name in ("greedy.completions", "greedy.chat", "stream.chat", "stop.chat", "n.completions", "logprobs.chat",
                 "usage.completions", "usage.tokenize", "sse.completions", "sse.chat", "cancel.stream.chat",
                 "cancel.whole", "bad-input.invalid-json", "bad-input.still-serving"):
        assert verdicts[name] == "PASS", name
    greedy = next(c for c in doc["checks"] if c["name"] == "greedy.completions")
    assert greedy["data"]["equal"] == greedy["data"]["cases"] == 9 and colocated.url in greedy["detail"]
    cancel = next(c for c in doc["checks"] if c["name"] == "cancel.stream.completions")
    assert "back to 0" in cancel["detail"]  # the prefill's and the decode's in-flight counters were read
    assert "PASS" in proc.stdout and "checks" in proc.stdout.splitlines()[-2]  # the table and its count line


def test_a_decode_killed_under_streaming_load(clusters):
    pd, colocated, tmp = clusters
    pid_file = pd.log_dir / "decode-0.pid"
    victim = int(pid_file.read_text())
    assert victim == pd.server("decode-0")["pid"]
    proc, doc = conformance(tmp, "faults", "--url", pd.url, "--reference-url", colocated.url, "--areas", "faults",
                            "--kill-cmd", f"decode=kill -9 $(cat {pid_file})", "--fault-max-tokens",
                            str(FAULT_MAX_TOKENS))
    checks = {c["name"]: c for c in doc["checks"]}
    kill = checks["faults.kill-decode"]
    assert kill["verdict"] == "PASS" and proc.returncode == 0, (kill, proc.stdout[-3000:])
    counts = kill["data"]["counts"]
    assert sum(counts.values()) == 4 and counts["hung"] == counts["cut"] == counts["wrong"] == 0, counts
    assert kill["data"]["kill_exit"] == 0 and kill["data"]["open_after_kill"] > 0
    assert checks["faults.recover-decode"]["verdict"] == "PASS"
    assert "decode-0 (pid %d) killed by SIGKILL" % victim in pd.log.read_text(errors="replace")
    assert int(pid_file.read_text()) != victim  # the supervisor's restart wrote its new pid
    assert {c["name"] for c in doc["checks"] if c["verdict"] == "SKIP"} == {
        "correctness.*", "client.*", "bad-input.*", "cancellation.*"}
