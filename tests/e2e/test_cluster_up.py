"""`pdserve up`: starts prefill + decodes, prints how to call it, serves, and on Ctrl-C
drains the in-flight request before stopping every process."""

import http.client
import json
import os
import signal
import threading
import time

import pytest

from pdserve.test_hooks import DECODE_STEP_FLOOR_ENV as TEST_STEP_FLOOR_ENV
from pdserve.net import free_port

pytestmark = pytest.mark.slow
# test_up_serves_and_ctrl_c_drains: the decodes' steps last >= 10 ms (a test hook `pdserve up` passes on
# to them), so the 600-token stream lasts >= 6 s and is still in flight when Ctrl-C reaches the prefill,
# however fast the CPU decodes or however late a starved test sends the signal
DRAIN_STEP_FLOOR_S = 0.01


def start_up(procs, tmp_path, decodes: int, prefills: int = 1, env: dict | None = None, extra=()):
    """`pdserve up` with `prefills` prefills and `decodes` decodes, once it printed its banner: (process, port, banner)."""  # noqa: E501
    port, grpc_port = free_port(), free_port()
    up = procs.start([str(procs_bin()), "up", "--model", "tiny", "--prefill", str(prefills), "--decode", str(decodes),
                      "--port", str(port), "--grpc-port", str(grpc_port), "--log-dir", str(tmp_path / "up-logs"),
                      *extra], name="up", env=env)
    log = tmp_path / "logs" / "up.log"
    deadline = time.monotonic() + 180
    while "pdserve is up" not in log.read_text(errors="replace"):
        assert up.poll() is None, log.read_text(errors="replace")
        assert time.monotonic() < deadline, "pdserve up did not become ready"
        time.sleep(0.3)
    return up, port, log.read_text(errors="replace")


def test_up_serves_and_ctrl_c_drains(procs, tmp_path):
    up, port, banner = start_up(procs, tmp_path, decodes=2, env={TEST_STEP_FLOOR_ENV: str(DRAIN_STEP_FLOOR_S)})
    assert f"http://127.0.0.1:{port}/v1" in banner and "curl" in banner and "OpenAI(" in banner

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "drain me", "max_tokens": 600,
                                                        "ignore_eos": True, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = []
    first = threading.Event()

    def read():
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: "):
                events.append(line[6:])
                first.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first.wait(60)
    os.killpg(up.pid, signal.SIGINT)  # Ctrl-C
    reader.join(120)
    assert events[-1] == "[DONE]" and not any(e.startswith('{"error"') for e in events)
    finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finish[-1] == "length"
    assert up.wait(60) == 0
    logs = {p.name: p.read_text(errors="replace") for p in (tmp_path / "up-logs").glob("*.log")}
    assert sorted(logs) == ["decode-0.log", "decode-1.log", "prefill-0.log"]
    assert "draining 1 in-flight request" in logs["prefill-0.log"]
    assert all("draining" in logs[f"decode-{i}.log"] for i in range(2))  # decodes were stopped after prefill


def test_two_prefills_get_a_router_in_front(procs, tmp_path):
    """--prefill 2: a router takes --port and spreads conversations over both prefills."""
    up, port, banner = start_up(procs, tmp_path, decodes=1, prefills=2)
    assert "1 router" in banner and f"http://127.0.0.1:{port}/v1" in banner
    texts = []
    for prompt in ("a conversation about tea", "another one about ships", "a third about rain"):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8,
                                                            "temperature": 0}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert resp.status == 200, body
        texts.append(body["choices"][0]["text"])
    assert len(texts) == 3
    # the banner's gRPC port is the router's: Generate is relayed to a prefill
    import re

    import grpc

    from pdserve.protos import generate_pb2 as gpb
    from pdserve.protos import generate_pb2_grpc as gpb_grpc

    grpc_address = re.search(r"gRPC Generate: (\S+)", banner).group(1)
    with grpc.insecure_channel(grpc_address) as channel:
        replies = list(gpb_grpc.GeneratorStub(channel).Generate(
            gpb.GenerateRequest(prompt="a conversation about tea", max_tokens=8, temperature=0.0), timeout=60))
    assert "".join(r.text for r in replies) == texts[0]
    metrics = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    metrics.request("GET", "/metrics")
    text = metrics.getresponse().read().decode()
    assert "pdserve_router" in text
    os.killpg(up.pid, signal.SIGINT)
    assert up.wait(90) == 0
    logs = sorted(p.name for p in (tmp_path / "up-logs").glob("*.log"))
    assert logs == ["decode-0.log", "prefill-0.log", "prefill-1.log", "router.log"]


def procs_bin():
    from harness.procs import VENV_BIN

    return VENV_BIN / "pdserve"


def test_servers_stop_when_up_is_killed(procs, tmp_path):
    """SIGKILL of `pdserve up` (nothing can run in it) still stops every server it started."""
    up, _, _ = start_up(procs, tmp_path, decodes=1)
    children = [int(p) for p in os.popen(f"pgrep -P {up.pid}").read().split()]
    assert len(children) == 2
    os.killpg(up.pid, signal.SIGKILL)
    up.wait(10)
    deadline = time.monotonic() + 60
    alive = children
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in children if os.path.exists(f"/proc/{pid}") and
                 open(f"/proc/{pid}/stat").read().split()[2] != "Z"]
        time.sleep(0.3)
    assert not alive, f"servers still running after pdserve up was killed: {alive}"


def test_up_starts_a_simulated_cluster(procs, tmp_path):
    """--engine sim --prefill 2 --decode 4: six sim servers and a router start and serve; each server's log
    names the profile."""
    up, port, banner = start_up(procs, tmp_path, decodes=4, prefills=2, extra=["--engine", "sim"])
    assert "1 router" in banner
    for prompt in ("simulated tea", "simulated ships"):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8,
                                                            "temperature": 0}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert resp.status == 200, body
        assert body["usage"]["completion_tokens"] == 8  # the sim runs every request to max_tokens
    os.killpg(up.pid, signal.SIGINT)
    assert up.wait(90) == 0
    logs = {p.name: p.read_text(errors="replace") for p in (tmp_path / "up-logs").glob("*.log")}
    servers = [n for n in logs if n != "router.log"]
    assert len(servers) == 6 and all("simulated engine: profile cpu-small" in logs[n] for n in servers), sorted(logs)
