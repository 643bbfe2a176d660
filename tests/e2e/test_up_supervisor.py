"""`pdserve up` supervises its servers: a SIGKILLed decode under load comes back on its ports
while the rest keeps serving; in-flight streams complete (resumed) or end with an error event,
never hang; `--restart never` still stops everything."""

import http.client
import json
import os
import signal
import threading
import time

import pytest

from harness.procs import VENV_BIN
from pdserve.net import free_port

pytestmark = pytest.mark.slow


def start_up(procs, tmp_path, *extra: str):
    """`pdserve up --prefill 1 --decode 2` once it printed its banner: (process, port, up log, log dir)."""
    port, grpc_port, log_dir = free_port(), free_port(), tmp_path / "up-logs"
    up = procs.start([str(VENV_BIN / "pdserve"), "up", "--model", "tiny", "--prefill", "1", "--decode", "2",
                      "--port", str(port), "--grpc-port", str(grpc_port), "--log-dir", str(log_dir), *extra], name="up")
    log = tmp_path / "logs" / "up.log"
    deadline = time.monotonic() + 240
    while "pdserve is up" not in log.read_text(errors="replace"):
        assert up.poll() is None, log.read_text(errors="replace")
        assert time.monotonic() < deadline, "pdserve up did not become ready"
        time.sleep(0.3)
    return up, port, log, log_dir


def servers(log_dir) -> dict:
    return json.loads((log_dir / "servers.json").read_text())


def stream(port: int, prompt: str, max_tokens: int, out: dict, first: threading.Event | None = None) -> None:
    """One streaming completion; out gets 'events' (data lines), 'status' and 'error' (a client-side exception)."""
    out["events"] = []
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=90)  # a read that waits 90 s fails the test
        conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                            "ignore_eos": True, "stream": True, "temperature": 0}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        out["status"] = resp.status
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: "):
                out["events"].append(line[6:])
                if first is not None:
                    first.set()
    except Exception as e:  # noqa: BLE001 - recorded and asserted on below
        out["error"] = f"{type(e).__name__}: {e}"


def http_ok(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_killed_decode_restarts_and_streams_complete_or_end_clearly(procs, tmp_path):
    up, port, log, log_dir = start_up(procs, tmp_path)
    before = servers(log_dir)
    victim = before["decode-0"]
    outs, threads, firsts = [], [], []
    for i in range(4):
        out, first = {}, threading.Event()
        t = threading.Thread(target=stream, args=(port, f"stream {i} under load", 300, out, first), daemon=True)
        t.start()
        outs.append(out), threads.append(t), firsts.append(first)
    assert all(f.wait(120) for f in firsts), outs
    os.kill(victim["pid"], signal.SIGKILL)

    fresh = {}
    stream(port, "a new request after the kill", 16, fresh)
    assert fresh.get("status") == 200 and fresh["events"][-1] == "[DONE]", fresh

    for t in threads:
        t.join(150)
    assert not any(t.is_alive() for t in threads), "a stream hung after its decode was killed"
    for out in outs:
        assert "error" not in out, out.get("error")  # no client-side timeout or cut connection
        events = out["events"]
        ended_with_error = any(e.startswith('{"error"') for e in events)
        completed = events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert completed or ended_with_error, events[-3:]

    deadline = time.monotonic() + 120
    while not http_ok(victim["ready_url"]):
        assert up.poll() is None, log.read_text(errors="replace")
        assert time.monotonic() < deadline, "the killed decode did not come back"
        time.sleep(0.5)
    text = log.read_text(errors="replace")
    assert f"decode-0 (pid {victim['pid']}) killed by SIGKILL" in text and "(restart 1)" in text, text[-2000:]
    after = servers(log_dir)
    assert after["decode-0"]["restarts"] == 1 and after["decode-0"]["pid"] != victim["pid"]
    assert after["decode-1"]["pid"] == before["decode-1"]["pid"]  # the others kept running
    assert after["prefill-0"]["pid"] == before["prefill-0"]["pid"]

    # the restarted decode is routed to again (its load reports are picked up on the same port)
    deadline = time.monotonic() + 60
    while _known_decodes(port) != 2:
        assert time.monotonic() < deadline, f"prefill does not see 2 decodes again: {_known_decodes(port)}"
        time.sleep(0.5)
    up.send_signal(signal.SIGINT)
    assert up.wait(90) == 0


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def _known_decodes(port: int) -> float:
    for line in _get(f"http://127.0.0.1:{port}/metrics").splitlines():
        if line.startswith("pdserve_known_decodes{"):
            return float(line.rsplit(" ", 1)[1])
    return -1.0


def test_restart_never_stops_everything(procs, tmp_path):
    up, _, log, log_dir = start_up(procs, tmp_path, "--restart", "never")
    pids = {name: s["pid"] for name, s in servers(log_dir).items()}
    os.kill(pids["decode-1"], signal.SIGKILL)
    assert up.wait(90) == 1
    text = log.read_text(errors="replace")
    assert "decode-1 exited (killed by SIGKILL); --restart never" in text, text[-2000:]
    for name, pid in pids.items():  # every other server was stopped too
        alive = os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"
        assert not alive, f"{name} still running"
