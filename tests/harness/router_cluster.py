"""A router in front of real prefills sharing one decode, for the router's multi-process tests."""

from __future__ import annotations

import time

from harness.pd_cluster import Server, get_json, start_decode, start_prefill, wait_ready
from pdserve.net import free_port


def start_prefills(group, n: int = 2, extra=(), step_floor_s: float = 0.0) -> tuple[Server, list[Server]]:
    """One decode (128 blocks; each step lasting at least ``step_floor_s``) and ``n`` prefills that know it, all ready."""  # noqa: E501
    decode = start_decode(group, num_blocks=128, extra=extra, name="decode", step_floor_s=step_floor_s)
    wait_ready(decode)
    prefills = [start_prefill(group, [decode.grpc_address], extra=extra, name=f"prefill{i}") for i in range(n)]
    for p in prefills:
        wait_ready(p)
    return decode, prefills


def start_router(group, prefills: list[Server], http_port: int | None = None, grpc_port: int = 0,
                 name: str = "router", prefill_file=None, extra=()) -> Server:
    """``pdserve router`` over the prefills (load polled every 0.1 s); gRPC Generate when grpc_port is given;
    ``prefill_file``: file discovery (the prefills are written there) instead of a static list."""
    http_port = http_port or free_port()
    args = ["router", "--port", str(http_port), "--model", "tiny", "--load-interval", "0.1"]
    if prefill_file is not None:
        prefill_file.write_text("\n".join(p.grpc_address for p in prefills) + "\n")
        args += ["--discovery", "file", "--prefill-file", str(prefill_file), "--discovery-interval", "0.1"]
    else:
        args += ["--prefill", ",".join(p.grpc_address for p in prefills)]
    if grpc_port:
        args += ["--grpc-port", str(grpc_port)]
    args += list(extra)
    return Server(group.pdserve(*args, name=name), http_port, grpc_port, 0, name)


def wait_until(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def relays_in_flight(router: Server) -> dict:
    """The router's requests in flight (HTTP, gRPC) and, per prefill, the relays to it now (all 0 once every
    relay ended)."""
    health = get_json(router.url + "/health")[1]
    return {"in_flight": health["in_flight"], "in_flight_grpc": health["in_flight_grpc"],
            **{p: w["in_flight_here"] for p, w in health["prefills"].items()}}
