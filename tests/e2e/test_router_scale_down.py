"""A prefill that leaves the router's discovery mid-stream (a scale-down) finishes its relays.

Real processes: one decode, one prefill, a router over file discovery with gRPC Generate. A
long stream is started through the router; the prefill is then removed from the discovery
file. The router drops it from routing at once (a new request gets UNAVAILABLE, "no prefill is
routable") but the stream already relayed on its channel runs to its last token (the channel
closes with a grace, not at once). Afterwards nothing is held and the relay count is zero.
Before the scale-down, the client's ``X-Request-Timeout`` reaches the prefill through the router:
a long request with a short deadline gets the prefill's 504.
"""

import os

import grpc
import pytest

from harness.pd_cluster import get_json, metric, nothing_held, post_json, wait_all_released, wait_ready
from harness.procs import ProcessGroup
from harness.router_cluster import start_prefills, start_router, wait_until
from pdserve.net import free_port
from pdserve.protos import generate_pb2 as gpb
from pdserve.protos import generate_pb2_grpc as gpb_grpc

pytestmark = pytest.mark.slow

MAX_TOKENS = 400


def test_a_relay_outlives_its_prefill_leaving_discovery(tmp_path):
    group = ProcessGroup(log_dir=tmp_path / "logs")
    try:
        decode, (prefill,) = start_prefills(group, n=1)
        listing = tmp_path / "prefills.txt"
        router = start_router(group, [prefill], grpc_port=free_port(), prefill_file=listing)
        wait_ready(router)
        prompt = [256] + [97 + i % 26 for i in range(1999)]  # its prefill alone outlasts the deadline
        status, body = post_json(router.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 4},
                                 headers={"X-Request-Timeout": "0.05"})
        assert status == 504 and body["error"]["code"] == "request_timeout", (status, body)
        with grpc.insecure_channel(f"127.0.0.1:{router.grpc_port}") as ch:
            stub = gpb_grpc.GeneratorStub(ch)
            stream = stub.Generate(gpb.GenerateRequest(prompt="a long story", max_tokens=MAX_TOKENS, ignore_eos=True,
                                                       temperature=0.0), timeout=120)
            first = next(stream)
            tmp = listing.with_suffix(".tmp")
            tmp.write_text("")
            os.replace(tmp, listing)  # the scale-down: as pdserve up --autoscale rewrites the file
            wait_until(lambda: prefill.grpc_address not in get_json(router.url + "/health")[1]["prefills"],
                       "the router dropping the prefill", timeout=10)
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(gpb.GenerateRequest(prompt="hi", max_tokens=4), timeout=30))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
            assert "no prefill is routable" in refused.value.details()
            rest = list(stream)  # the relay started before the scale-down runs to its end
        tokens = len(first.token_ids) + sum(len(r.token_ids) for r in rest)
        assert tokens == MAX_TOKENS and rest[-1].finish_reason == "length", (tokens, rest[-1:])
        assert metric(router.url, "pdserve_requests_total", outcome="ok", reason="relayed") == 1
        assert metric(router.url, "pdserve_requests_total", outcome="error", reason="http_504") == 1
        readings = wait_all_released([prefill, decode], timeout=20.0)
        assert nothing_held(readings), readings
    finally:
        group.close()
