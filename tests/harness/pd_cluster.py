"""Helpers for the multi-process P/D tests: start real decode and prefill processes on
free loopback ports, wait until they are ready, read their /health counters, and check
that every KV block, Session and CacheStore entry is back to zero.

Processes are started through the test's ProcessGroup, so they are killed after the
test whatever happens.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from pdserve.net import free_port

# Keep the model tiny and the CPU use modest: the machine is shared.
COMMON = ["--model", "tiny", "--threads", "1", "--log-level", "INFO"]
# Counters in CacheStore stats that are "things held" (must return to 0); totals are not.
HELD_KEYS = ("pinned", "inflight", "queued", "sending", "receiving", "waiters")
POLL_S = 0.05  # the pause between two polls of a condition


@dataclass
class Server:
    proc: object
    http_port: int
    grpc_port: int
    kv_port: int = 0
    name: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


def get_json(url: str, timeout: float = 5.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def post_json(url: str, body, timeout: float = 60.0, raw: bytes | None = None, headers=None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def wait_ready(server: Server, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode} before it was ready")
        try:
            status, last = get_json(server.url + "/ready", timeout=1.0)
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{server.name} not ready within {timeout}s (last /ready: {last})")


def start_decode(procs, transfer: str = "tcp", num_blocks: int = 64, extra=(), name: str = "decode",
                 grpc_port: int | None = None, step_floor_s: float = 0.0, env: dict | None = None,
                 same_node: str = "off") -> Server:
    """``same_node``: ``--kv-same-node`` (off by default here: a test of ``transfer`` moves KV by it;
    tests/e2e/test_pd_same_node.py covers the same-node path). ``grpc_port``: a port chosen before (a prefill
    may list the decode before it starts).
    ``step_floor_s``: every decode step lasts at least this long (the test hook
    ``PDSERVE_TEST_DECODE_STEP_FLOOR_S``): a stream of N tokens lasts >= N x that on any CPU, for a
    test that acts while it still runs. ``env``: more of the process's environment (other test hooks)."""
    from pdserve.test_hooks import DECODE_STEP_FLOOR_ENV as TEST_STEP_FLOOR_ENV

    grpc_port, http_port, kv_port = grpc_port or free_port(), free_port(), free_port()
    env = {**({TEST_STEP_FLOOR_ENV: str(step_floor_s)} if step_floor_s else {}), **(env or {})} or None
    proc = procs.pdserve("decode", "--port", str(grpc_port), "--http-port", str(http_port), "--kv-port", str(kv_port),
                         "--transfer", transfer, "--kv-same-node", same_node, "--num-blocks", str(num_blocks), *COMMON,
                         *extra, name=name, env=env)
    return Server(proc, http_port, grpc_port, kv_port, name)


def start_prefill(procs, decodes: list[str], transfer: str = "tcp", num_blocks: int = 64, extra=(),
                  name: str = "prefill", env: dict | None = None, same_node: str = "off") -> Server:
    http_port, grpc_port = free_port(), free_port()
    proc = procs.pdserve("prefill", "--port", str(http_port), "--grpc-port", str(grpc_port), "--decode",
                         ",".join(decodes),
                         "--transfer", transfer, "--kv-same-node", same_node, "--num-blocks", str(num_blocks), *COMMON,
                         *extra, name=name, env=env)
    return Server(proc, http_port, grpc_port, 0, name)


def held(health: dict) -> dict:
    """What a server still holds for requests: sessions, used KV blocks, CacheStore entries,
    requests in flight and in the admission queue, and requests the SLO queue counts as admitted
    (prefill)."""
    out = {"sessions": health["sessions"], "kv_blocks_used": health["kv_blocks_used"]}
    for key, value in (health.get("cachestore") or {}).items():
        if isinstance(value, (int, float)) and any(k in key for k in HELD_KEYS):
            out[f"cachestore.{key}"] = value
    for key in ("in_flight", "queued", "slo_running",
                "swapped_requests"):  # prefill: in flight, queued, admitted; decode: evicted
        if key in health:
            out[key] = health[key]
    return out


def wait_all_released(servers: list[Server], timeout: float = 10.0) -> dict:
    """Poll /health until every server holds nothing; return the last readings (assert on them).
    `timeout` is a hang guard; polls are 50 ms apart (a poll without a pause takes the CPU from the
    servers it waits for)."""
    deadline = time.monotonic() + timeout
    while True:
        readings = {s.name: held(get_json(s.url + "/health")[1]) for s in servers}
        if all(v == 0 for r in readings.values() for v in r.values()) or time.monotonic() > deadline:
            return readings
        time.sleep(POLL_S)


def nothing_held(readings: dict) -> bool:
    return all(v == 0 for r in readings.values() for v in r.values())


def metric(url: str, name: str, **labels) -> float:
    """Sum of a server's metric samples called ``name`` whose labels include ``labels`` (0 when absent)."""
    from pdserve.bench.experiments.launcher import metric_sum, scrape

    return metric_sum(scrape(url + "/metrics"), name, **labels)
