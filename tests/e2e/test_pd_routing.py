"""Weighted round robin on live free KV memory, with real processes and real load reports.

Two decodes, one with half the KV blocks of the other: with ``--policy wrr`` the small one
gets about a third of new requests; with ``--policy rr`` exactly half.
"""

import re
import urllib.request

import pytest

from harness.pd_cluster import nothing_held, post_json, start_decode, start_prefill, wait_all_released, wait_ready

pytestmark = pytest.mark.slow
N = 30


def selections(prefill) -> dict[str, float]:
    text = urllib.request.urlopen(prefill.url + "/metrics", timeout=5).read().decode()
    out = {}
    for m in re.finditer(r'^pdserve_decode_selections_total\{[^}]*decode="([^"]+)"[^}]*\} (\S+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


@pytest.mark.parametrize("policy, low, high", [("wrr", 0.22, 0.45), ("rr", 0.45, 0.55)])
def test_share_of_the_half_memory_decode(procs, policy, low, high):
    big = start_decode(procs, num_blocks=64, name="big")
    small = start_decode(procs, num_blocks=32, name="small")
    for d in (big, small):
        wait_ready(d)
    prefill = start_prefill(procs, [big.grpc_address, small.grpc_address], extra=["--policy", policy])
    wait_ready(prefill)
    for i in range(N):
        status, body = post_json(prefill.url + "/v1/completions",
                                 {"model": "tiny", "prompt": f"request {i}", "max_tokens": 2})
        assert status == 200, body
    counts = selections(prefill)
    assert sum(counts.values()) == N, counts
    share = counts.get(small.grpc_address, 0) / N
    print(f"{policy}: the decode with half the free KV memory got {share:.2f} of {N} requests ({counts})")
    assert low <= share <= high, f"{policy}: small decode got {share:.2f} of requests ({counts})"
    readings = wait_all_released([prefill, big, small])
    assert nothing_held(readings), readings
