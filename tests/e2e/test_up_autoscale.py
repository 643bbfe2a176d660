"""`pdserve up --autoscale` with real processes: a decode drained by a scale-down while streams
run on it loses none of them (prefills run --no-resume, so a cut stream would end in an error,
not be resumed elsewhere); a decode pool out of KV gets another decode, which prefills find
through the discovery file; and a prefill lets the Sessions on a decode that left discovery
finish (its channel closes with a grace, not at once)."""

import http.client
import json
import os
import re
import threading
import time

import pytest

from harness.pd_cluster import get_json, metric, nothing_held, start_decode, start_prefill, wait_all_released, wait_ready
from harness.procs import VENV_BIN
from pdserve.net import free_port

pytestmark = pytest.mark.slow

FAST = ["--plan-interval", "1", "--plan-window", "2", "--cooldown", "1", "--slo-ttft-ms", "20000", "--slo-tbt-ms", "5000",
        "--max-prefill", "1", "--prefill-extra=--no-resume", "--threads", "1"]


def start_up(procs, tmp_path, *extra: str):
    """`pdserve up --autoscale` with FAST planning once it printed its banner (flags in ``extra`` win)."""
    port, grpc_port, log_dir = free_port(), free_port(), tmp_path / "up-logs"
    up = procs.start([str(VENV_BIN / "pdserve"), "up", "--autoscale", "--model", "tiny", "--port", str(port),
                      "--grpc-port", str(grpc_port), "--log-dir", str(log_dir), *FAST, *extra], name="up")
    log = tmp_path / "logs" / "up.log"
    deadline = time.monotonic() + 240
    while "pdserve is up" not in log.read_text(errors="replace"):
        assert up.poll() is None, log.read_text(errors="replace")
        assert time.monotonic() < deadline, "pdserve up did not become ready"
        time.sleep(0.3)
    return up, port, log, log_dir


def stream(port: int, prompt: str, max_tokens: int, out: dict, first: threading.Event) -> None:
    out["events"] = []
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=150)
        conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                            "ignore_eos": True, "stream": True, "temperature": 0}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        out["status"] = resp.status
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: "):
                out["events"].append(line[6:])
                first.set()
    except Exception as e:  # noqa: BLE001 - asserted on below
        out["error"] = f"{type(e).__name__}: {e}"
    first.set()


def start_streams(port: int, n: int, max_tokens: int, tag: str):
    runs = []
    for i in range(n):
        out, first = {}, threading.Event()
        t = threading.Thread(target=stream, args=(port, f"{tag} {i}", max_tokens, out, first), daemon=True)
        t.start()
        runs.append((t, out, first))
    return runs


def assert_all_completed(runs) -> None:
    for t, _, _ in runs:
        t.join(240)
    for t, out, _ in runs:
        assert not t.is_alive(), "a stream hung"
        assert "error" not in out and out.get("status") == 200, out.get("error") or out.get("status")
        events = out["events"]
        assert not any(e.startswith('{"error"') for e in events), events[-3:]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length", events[-3:]


def servers(log_dir) -> dict:
    return json.loads((log_dir / "servers.json").read_text())


def wait_for(what: str, check, timeout: float = 120.0, up=None, log=None):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if up is not None:
            assert up.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s" + (
            f"\n{log.read_text(errors='replace')[-3000:]}" if log else "")
        time.sleep(0.3)
    return value


def test_a_decode_drained_by_scale_down_under_load_loses_no_stream(procs, tmp_path):
    # 2 decodes with big KV pools: 6 long streams fill a few percent of them, so the planner may go to one
    # decode (after watching 3 s), while both decodes are serving streams.
    up, port, log, log_dir = start_up(procs, tmp_path, "--prefill", "1", "--decode", "2", "--min-decode", "1",
                                      "--max-decode", "2", "--num-blocks", "2048", "--scale-down-window", "3")
    runs = start_streams(port, 6, 1800, "long stream")
    assert all(first.wait(120) for _, _, first in runs)
    drained = wait_for("a decode drains", lambda: re.search(r"draining (decode-\d)", log.read_text()), up=up, log=log)
    victim = drained.group(1)
    assert "[autoscale] decode 2 -> 1" in log.read_text()
    assert_all_completed(runs)

    wait_for("the drained decode is gone", lambda: f"{victim} drained and stopped (exit code 0)" in log.read_text(),
             up=up, log=log)
    victim_log = (log_dir / f"{victim}.log").read_text()
    sessions = int(re.search(r"draining (\d+) session", victim_log).group(1))
    assert sessions >= 1, "the drained decode had no stream in flight: the test proved nothing"
    assert "still open" not in victim_log
    left = servers(log_dir)
    assert victim not in left and [n for n in left if n.startswith("decode")] != []
    listed = (log_dir / "decodes.txt").read_text().split()
    assert listed == [left[n]["address"] for n in left if n.startswith("decode")]
    prefill_url = f"http://127.0.0.1:{port}"
    assert metric(prefill_url, "pdserve_decode_retries_total") == 0      # nothing was moved, nothing resumed
    assert metric(prefill_url, "pdserve_requests_total", outcome="error") == 0
    after = start_streams(port, 1, 16, "after the scale-down")
    assert_all_completed(after)
    up.send_signal(2)
    assert up.wait(90) == 0


def test_a_decode_pool_out_of_kv_gets_another_decode_that_prefills_use(procs, tmp_path):
    # one decode of 16 blocks (1024 tokens): two streams of ~410 tokens fill it, the rest queue at prefill
    up, port, log, log_dir = start_up(procs, tmp_path, "--prefill", "1", "--decode", "1", "--min-decode", "1",
                                      "--max-decode", "2", "--num-blocks", "16", "--scale-down-window", "600",
                                      "--prefill-extra=--no-resume --queue-timeout 180")
    runs = start_streams(port, 6, 400, "burst")
    wait_for("a scale-up", lambda: "[autoscale] decode 1 -> 2" in log.read_text(), up=up, log=log)
    new = wait_for("the new decode is ready", lambda: servers(log_dir).get("decode-1", {}).get("state") == "ready"
                   and servers(log_dir)["decode-1"], up=up, log=log)
    wait_for("it is listed", lambda: new["address"] in (log_dir / "decodes.txt").read_text(), up=up, log=log)
    wait_for("the prefill routes to it", lambda: new["address"] in get_json(
        f"http://127.0.0.1:{port}/health")[1]["routable_decodes"], up=up, log=log)
    more = start_streams(port, 4, 100, "after the scale-up")
    assert_all_completed(runs + more)
    prefill_url = f"http://127.0.0.1:{port}"
    assert metric(prefill_url, "pdserve_decode_selections_total", decode=new["address"]) >= 1
    assert metric(prefill_url, "pdserve_requests_total", outcome="error") == 0
    reason = next(json.loads(line)["reason"] for line in (log_dir / "autoscale.jsonl").read_text().splitlines()
                  if json.loads(line)["pool"] == "decode" and json.loads(line)["desired"] == 2
                  and json.loads(line)["current"] == 1)
    assert "KV" in reason
    up.send_signal(2)
    assert up.wait(90) == 0


def test_a_prefill_drained_by_scale_down_behind_the_router_loses_no_stream(procs, tmp_path):
    # 2 prefills behind the router, all but idle (busy ~0): the planner goes to one prefill while
    # streams relayed by both are running.
    up, port, log, log_dir = start_up(procs, tmp_path, "--prefill", "2", "--min-prefill", "1", "--max-prefill", "2",
                                      "--decode", "1", "--max-decode", "1", "--num-blocks", "2048",
                                      "--scale-down-window", "3")
    assert servers(log_dir)["router"]["state"] == "ready"
    runs = start_streams(port, 6, 1800, "routed stream")
    assert all(first.wait(120) for _, _, first in runs)
    drained = wait_for("a prefill drains", lambda: re.search(r"draining (prefill-\d)", log.read_text()), up=up, log=log)
    victim = drained.group(1)
    assert_all_completed(runs)
    wait_for("the drained prefill is gone", lambda: f"{victim} drained and stopped (exit code 0)" in log.read_text(),
             up=up, log=log)
    victim_log = (log_dir / f"{victim}.log").read_text()
    in_flight = int(re.search(r"draining (\d+) in-flight request", victim_log).group(1))
    assert in_flight >= 1, "the drained prefill had no stream in flight: the test proved nothing"
    assert "still in flight" not in victim_log
    assert (log_dir / "prefills.txt").read_text().split() == [
        s["address"] for n, s in servers(log_dir).items() if n.startswith("prefill")]
    assert metric(f"http://127.0.0.1:{port}", "pdserve_requests_total", outcome="error") == 0   # the router's count
    after = start_streams(port, 2, 16, "after the scale-down")
    assert_all_completed(after)
    up.send_signal(2)
    assert up.wait(90) == 0


def test_sessions_on_a_decode_that_left_discovery_finish(procs, tmp_path):
    decodes_file = tmp_path / "decodes.txt"
    decode = start_decode(procs, num_blocks=256)
    decodes_file.write_text(f"{decode.grpc_address}\n")
    prefill = start_prefill(procs, [], extra=["--discovery", "file", "--decode-file", str(decodes_file), "--no-resume"])
    wait_ready(decode), wait_ready(prefill)
    runs = start_streams(prefill.http_port, 2, 1500, "leaving")
    assert all(first.wait(60) for _, _, first in runs)
    tmp = tmp_path / "decodes.tmp"
    tmp.write_text("")
    os.replace(tmp, decodes_file)                                       # the decode leaves discovery mid-stream
    wait_for("the prefill forgets it", lambda: get_json(prefill.url + "/health")[1]["decodes"] == [])
    assert_all_completed(runs)
    assert metric(prefill.url, "pdserve_decode_retries_total") == 0
    assert nothing_held(wait_all_released([prefill, decode]))
