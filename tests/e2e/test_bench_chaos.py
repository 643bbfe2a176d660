"""`pdserve bench chaos` end to end, in its smoke form (8 s of load, a fault every ~2 s): it starts its
own supervised cluster, injects faults under a small load and writes a JSON with every request and
fault; no request may come back with text that differs from its fault-free reference, and none hangs.
These check the mechanism; how much completes under a given fault rate is the benchmark's figure
(docs/benchmarks.md, 10-minute runs), never asserted here."""

import json
import os
import shutil
import subprocess

import pytest

from harness.procs import VENV_BIN

pytestmark = pytest.mark.slow


def test_chaos_smoke_writes_the_report_and_nothing_is_wrong(tmp_path):
    cmd = [str(VENV_BIN / "pdserve"), "bench", "chaos", "--duration", "8", "--concurrency", "2", "--pool", "6",
           "--fault-interval", "2", "--leak-timeout", "20", "--out", str(tmp_path), "--name", "smoke", "--no-progress"]
    # bench chaos stops the `pdserve up` it started in every case; the timeout only guards the test
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]  # 1: a target missed, still reported
    assert (tmp_path / "smoke.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "smoke.json").read_text())
    assert (tmp_path / "smoke.png").stat().st_size > 0
    s = doc["summary"]
    for key in ("requests", "completed", "failed", "cut", "hung", "wrong", "leaked", "completed_pct",
                "completed_pct_serving", "faults"):
        assert key in s, key
    assert s["requests"] == len(doc["requests"]) > 0
    for r in doc["requests"]:
        assert {"start", "end", "outcome", "error", "checked", "longest_silence"} <= set(r)
        assert r["end"] >= r["start"]
    assert doc["faults"], "no fault was injected in 8 s"
    for f in doc["faults"]:
        assert {"time", "kind", "target", "pid"} <= set(f)
    assert set(doc["final_readings"]) == {"prefill-0", "decode-0", "decode-1", "decode-2"}
    assert s["wrong"] == 0, [r for r in doc["requests"] if r["outcome"] == "wrong"][:3]
    assert s["hung"] == 0, [r for r in doc["requests"] if r["outcome"] == "hung"][:3]


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [ln.split()[0] for ln in out.splitlines() if ln.strip()]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tc") or not shutil.which("ip"),
                    reason="--netem needs root, ip and tc")
def test_chaos_netem_runs_in_its_own_namespace_records_netem_faults_and_deletes_it(tmp_path):
    cmd = [str(VENV_BIN / "pdserve"), "bench", "chaos", "--netem", "--faults", "netem", "--duration", "8",
           "--concurrency", "2", "--pool", "6", "--fault-interval", "2", "--leak-timeout", "20", "--out", str(tmp_path),
           "--name", "netem", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode in (0, 1), out[-4000:]
    ns = f"pdchaos-{proc.pid}"
    assert f"network namespace {ns} deleted" in out, out[-4000:]
    assert ns not in _namespaces()
    assert (tmp_path / "netem.json").exists(), out[-4000:]  # a run that failed before its report says why
    doc = json.loads((tmp_path / "netem.json").read_text())
    assert doc["config"]["netns"] == ns and doc["netem"]
    assert doc["faults"] and all(f["kind"] == "netem" and f["target"] == "prefill<->decode" for f in doc["faults"])
    assert all(f["netem"] and f["recovered_at"] is not None and f["netem_stats"] for f in doc["faults"])
    # the shaped class saw the prefill <-> decode traffic of the requests
    assert sum(st["sent_pkts"] + st["dropped"] for f in doc["faults"] for st in f["netem_stats"].values()) > 0
    s = doc["summary"]
    assert s["requests"] > 0
    assert s["wrong"] == 0, [r for r in doc["requests"] if r["outcome"] == "wrong"][:3]
    assert s["hung"] == 0, [r for r in doc["requests"] if r["outcome"] == "hung"][:3]
