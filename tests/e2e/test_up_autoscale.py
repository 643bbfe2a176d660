"""`pdserve up --autoscale` with real processes: a decode drained by a scale-down while streams
run on it loses none of them (prefills run --no-resume, so a cut stream would end in an error,
not be resumed elsewhere); a decode pool out of KV gets another decode, which prefills find
through the discovery file; and a prefill lets the Sessions on a decode that left discovery
finish (its channel closes with a grace, not at once).

No test relies on a stream outlasting a timer: the decodes run behind a closed test gate
(harness/decode_gate.py: each P/D stream is held on its decode, first token sent, blocks held,
nothing decoded) until the event the test is about has happened (the planner drained a server
that provably holds streams, a scale-up, a decode left discovery); then the gate opens and
every stream must finish. In the scale-down tests the planner itself is behind a gate
(harness/planner_gate.py) until the streams are placed, so it cannot drain a server first. The prefills' --session-timeout is raised so that a held stream is
never failed by the prefill's relay timer (30 s of silence from the decode), however slow the box.
"""  # noqa: E501

import http.client
import json
import os
import re
import threading
import time

import pytest

from harness.decode_gate import DecodeGate
from harness.planner_gate import PlannerGate
from harness.pd_cluster import (get_json, metric, nothing_held, start_decode, start_prefill, wait_all_released,
                                wait_ready)
from harness.procs import VENV_BIN
from pdserve.net import free_port

pytestmark = pytest.mark.slow

FAST = ["--plan-interval", "1", "--plan-window", "2", "--cooldown", "1", "--slo-ttft-ms", "20000", "--slo-tbt-ms",
        "5000", "--max-prefill", "1", "--prefill-extra=--no-resume --session-timeout 300", "--threads", "1"]
# (prefill: --no-resume, a cut stream is an error; --session-timeout 300, a held stream is not a silent decode)
# Streams held on a decode with their first token at the client: the prefill computes every prompt.
HELD = ["--disaggregation", "always"]
TOKENS = 200  # per held stream: enough to keep decoding after the gate opens; length no longer buys time
UP_HANG_GUARD_S = 240.0  # only a hang guard: `pdserve up` starts its servers in ~10-20 s
HANG_GUARD_S = 120.0     # only a hang guard: a planner decision, a start, a stream's first token: seconds


def start_up(procs, tmp_path, *extra: str, env: dict | None = None):
    """`pdserve up --autoscale` with FAST planning once it printed its banner (flags in ``extra`` win);
    ``env`` reaches every server it starts (they inherit its environment)."""
    port, grpc_port, log_dir = free_port(), free_port(), tmp_path / "up-logs"
    up = procs.start([str(VENV_BIN / "pdserve"), "up", "--autoscale", "--model", "tiny", "--port", str(port),
                      "--grpc-port", str(grpc_port), "--log-dir", str(log_dir), *FAST, *extra], name="up", env=env)
    log = tmp_path / "logs" / "up.log"
    wait_for("pdserve up prints its banner", lambda: "pdserve is up" in log.read_text(errors="replace"),
             UP_HANG_GUARD_S, up=up, log=log)
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


def wait_first_tokens(runs) -> None:
    for i, (_, out, first) in enumerate(runs):
        assert first.wait(HANG_GUARD_S), f"hang guard: stream {i} had no first token within {HANG_GUARD_S:g}s"
        assert out["events"] and "error" not in out, out


def assert_all_completed(runs) -> None:
    for t, _, _ in runs:
        t.join(240)  # only a hang guard
    for t, out, _ in runs:
        assert not t.is_alive(), "a stream hung"
        assert "error" not in out and out.get("status") == 200, out.get("error") or out.get("status")
        events = out["events"]
        assert not any(e.startswith('{"error"') for e in events), events[-3:]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length", events[-3:]


def servers(log_dir) -> dict:
    return json.loads((log_dir / "servers.json").read_text())


def health(server: dict) -> dict:
    """A server of servers.json: its /health (the ready URL's neighbour)."""
    return get_json(server["ready_url"].removesuffix("/ready") + "/health")[1]


def wait_for(what: str, check, timeout: float = HANG_GUARD_S, up=None, log=None):
    """``check()``'s first truthy value; ``timeout`` is only a hang guard, named in the failure."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if up is not None:
            assert up.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, f"hang guard: {what}: not within {timeout:g}s" + (
            f"\n{log.read_text(errors='replace')[-3000:]}" if log else "")
        time.sleep(0.2)
    return value


def routes_to_every(up, log, port: int, role: str, n: int) -> None:
    """Wait until the door at ``port`` routes to all ``n`` servers of ``role``: the prefill's picker lists every
    decode as eligible, or the router sees every prefill routable. A server that has not sent its first load
    report yet is not routed to, so streams started before then all go to the others (seen in CI on a busy box:
    6 streams on one decode, none on the other, which the scale-down tests need to hold one)."""

    def routable() -> bool:
        health = get_json(f"http://127.0.0.1:{port}/health")[1]
        if role == "decode":
            return len(health["routable_decodes"]) == n
        return sum(p["routable"] for p in health["prefills"].values()) == n

    wait_for(f"the door routes to every {role}", routable, up=up, log=log)


def held_everywhere(up, log, log_dir, role: str, count: str, gate: DecodeGate, n: int, runs,
                    planner: PlannerGate) -> dict[str, int]:
    """Wait until the decodes hold all ``n`` streams (each with its first token at the client) and every
    server of ``role`` has at least one in flight (``count`` of its /health), then open the planner's
    gate: its first window starts with the streams in place, so what it drains provably holds streams.
    Returns the count per server."""
    gate.wait_held(n, HANG_GUARD_S)
    wait_first_tokens(runs)
    members = {name: s for name, s in servers(log_dir).items() if s["role"] == role}

    def every_one_holds() -> dict[str, int] | None:
        counts = {name: health(s)[count] for name, s in members.items()}
        return counts if all(v >= 1 for v in counts.values()) else None

    counts = wait_for(f"every {role} holds a stream", every_one_holds, up=up, log=log)
    assert "[autoscale]" not in log.read_text(), "the planner acted behind its closed gate"
    planner.open()
    return counts


def test_a_decode_drained_by_scale_down_under_load_loses_no_stream(procs, tmp_path):
    # 2 decodes with big KV pools: 6 held streams fill a few percent of them, so the planner goes to one
    # decode (after watching 3 s) and drains the one with fewer streams, while both hold streams.
    gate, planner = DecodeGate(tmp_path / "decode-gate"), PlannerGate(tmp_path / "planner-gate")
    up, port, log, log_dir = start_up(procs, tmp_path, "--prefill", "1", "--decode", "2", "--min-decode", "1",
                                      "--max-decode", "2", "--num-blocks", "2048", "--scale-down-window", "3", *HELD,
                                      env={**gate.env, **planner.env})
    routes_to_every(up, log, port, "decode", 2)
    runs = start_streams(port, 6, TOKENS, "long stream")
    held = held_everywhere(up, log, log_dir, "decode", "sessions", gate, 6, runs, planner)
    assert sum(held.values()) == 6, held
    drained = wait_for("a decode drains", lambda: re.search(r"draining (decode-\d)", log.read_text()), up=up, log=log)
    victim = drained.group(1)
    assert "[autoscale] decode 2 -> 1" in log.read_text()
    victim_log = log_dir / f"{victim}.log"
    draining = wait_for(f"{victim} starts draining",
                        lambda: re.search(r"draining (\d+) session", victim_log.read_text()),
                        up=up, log=log)
    assert int(draining.group(1)) == held[victim] >= 1, (draining.group(0), held)  # the streams it holds, none done
    assert len(gate.held()) == 6                                           # still held: nothing decoded yet
    gate.open()
    assert_all_completed(runs)

    wait_for("the drained decode is gone", lambda: f"{victim} drained and stopped (exit code 0)" in log.read_text(),
             up=up, log=log)
    assert "still open" not in victim_log.read_text()
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
    # one decode of 16 blocks (1024 tokens): two held streams of ~410 tokens fill it (until the gate opens,
    # however fast the CPU), the rest queue at prefill; the planner sees the full pool for a whole window
    gate = DecodeGate(tmp_path / "decode-gate")
    up, port, log, log_dir = start_up(procs, tmp_path, "--prefill", "1", "--decode", "1", "--min-decode", "1",
                                      "--max-decode", "2", "--num-blocks", "16", "--scale-down-window", "600",
                                      "--prefill-extra=--no-resume --queue-timeout 180 --session-timeout 300",
                                      env=gate.env)
    runs = start_streams(port, 6, 400, "burst")
    gate.wait_held(2, HANG_GUARD_S)
    wait_for("a scale-up", lambda: "[autoscale] decode 1 -> 2" in log.read_text(), up=up, log=log)
    new = wait_for("the new decode is ready", lambda: servers(log_dir).get("decode-1", {}).get("state") == "ready"
                   and servers(log_dir)["decode-1"], up=up, log=log)
    wait_for("it is listed", lambda: new["address"] in (log_dir / "decodes.txt").read_text(), up=up, log=log)
    wait_for("the prefill routes to it", lambda: new["address"] in get_json(
        f"http://127.0.0.1:{port}/health")[1]["routable_decodes"], up=up, log=log)
    # the streams queued at prefill go to the new decode (the first one is still full, held)
    wait_for("the new decode holds a stream", lambda: health(new)["sessions"] >= 1, up=up, log=log)
    gate.open()
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
    # 2 prefills behind the router, all but idle (busy ~0, the prompts are computed): the planner goes to
    # one prefill while both relay streams held on the decode.
    gate, planner = DecodeGate(tmp_path / "decode-gate"), PlannerGate(tmp_path / "planner-gate")
    up, port, log, log_dir = start_up(procs, tmp_path, "--prefill", "2", "--min-prefill", "1", "--max-prefill", "2",
                                      "--decode", "1", "--max-decode", "1", "--num-blocks", "2048",
                                      "--scale-down-window", "3", *HELD, env={**gate.env, **planner.env})
    assert servers(log_dir)["router"]["state"] == "ready"
    routes_to_every(up, log, port, "prefill", 2)
    runs = start_streams(port, 6, TOKENS, "routed stream")
    held = held_everywhere(up, log, log_dir, "prefill", "in_flight", gate, 6, runs, planner)
    assert sum(held.values()) == 6, held
    drained = wait_for("a prefill drains", lambda: re.search(r"draining (prefill-\d)", log.read_text()), up=up, log=log)
    victim = drained.group(1)
    victim_log = log_dir / f"{victim}.log"
    draining = wait_for(f"{victim} starts draining",
                        lambda: re.search(r"draining (\d+) in-flight request", victim_log.read_text()), up=up, log=log)
    assert int(draining.group(1)) == held[victim] >= 1, (draining.group(0), held)  # the streams it relays, none done
    assert len(gate.held()) == 6                                           # still held: nothing decoded yet
    gate.open()
    assert_all_completed(runs)
    wait_for("the drained prefill is gone", lambda: f"{victim} drained and stopped (exit code 0)" in log.read_text(),
             up=up, log=log)
    assert "still in flight" not in victim_log.read_text()
    assert (log_dir / "prefills.txt").read_text().split() == [
        s["address"] for n, s in servers(log_dir).items() if n.startswith("prefill")]
    assert metric(f"http://127.0.0.1:{port}", "pdserve_requests_total", outcome="error") == 0   # the router's count
    after = start_streams(port, 2, 16, "after the scale-down")
    assert_all_completed(after)
    up.send_signal(2)
    assert up.wait(90) == 0


def test_sessions_on_a_decode_that_left_discovery_finish(procs, tmp_path, monkeypatch):
    gate = DecodeGate(tmp_path / "decode-gate")
    decodes_file = tmp_path / "decodes.txt"
    for name, value in gate.env.items():  # the decode only (start_decode passes our environment on)
        monkeypatch.setenv(name, value)
    decode = start_decode(procs, num_blocks=256)
    for name in gate.env:
        monkeypatch.delenv(name)
    decodes_file.write_text(f"{decode.grpc_address}\n")
    prefill = start_prefill(procs, [], extra=["--discovery", "file", "--decode-file", str(decodes_file), "--no-resume",
                                              "--disaggregation", "always", "--session-timeout", "300"])
    wait_ready(decode), wait_ready(prefill)
    runs = start_streams(prefill.http_port, 2, TOKENS, "leaving")
    gate.wait_held(2, HANG_GUARD_S)
    wait_first_tokens(runs)
    tmp = tmp_path / "decodes.tmp"
    tmp.write_text("")
    os.replace(tmp, decodes_file)                                       # the decode leaves discovery mid-stream
    wait_for("the prefill forgets it", lambda: get_json(prefill.url + "/health")[1]["decodes"] == [])
    assert get_json(decode.url + "/health")[1]["sessions"] == 2         # both streams still open on it
    gate.open()
    assert_all_completed(runs)
    assert metric(prefill.url, "pdserve_decode_retries_total") == 0
    assert nothing_held(wait_all_released([prefill, decode]))
