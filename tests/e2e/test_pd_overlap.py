"""Layer-wise overlap is real: decode receives the first layer's KV before prefill has
finished computing its last layer.

Timestamps are CLOCK_MONOTONIC (``time.monotonic``), which all processes of one Linux
machine share. The prefill reports when each layer's KV was written (the engine's layer
callback, right before the CacheStore store); the decode reports when each layer arrived
(its ``CacheStoreReceiver.load`` subscription woke).
"""

import pytest

from harness.pd_cluster import get_json, nothing_held, start_decode, start_prefill, wait_all_released, wait_ready

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_first_layer_arrives_before_last_layer_is_computed(procs, transport):
    from pdserve.protos import generate_pb2 as gpb
    import grpc
    from pdserve.protos import generate_pb2_grpc as gpb_grpc

    decode = start_decode(procs, transport, num_blocks=64, name="decode")
    wait_ready(decode)
    prefill = start_prefill(procs, [decode.grpc_address], transport, num_blocks=64)
    wait_ready(prefill)
    prompt = [256] + [97 + i % 26 for i in range(1999)]  # a long prompt: each layer takes a while
    wins = []
    for attempt in range(3):
        rid = f"overlap-{attempt}"
        with grpc.insecure_channel(f"127.0.0.1:{prefill.grpc_port}") as ch:
            list(gpb_grpc.GeneratorStub(ch).Generate(
                gpb.GenerateRequest(prompt_token_ids=prompt, max_tokens=2, temperature=0, request_id=rid), timeout=120))
        p = get_json(f"{prefill.url}/debug/requests/{rid}")[1]
        d = get_json(f"{decode.url}/debug/requests/{rid}")[1]
        assert len(p["layer_stored"]) == 4 and len(d["layer_arrived"]) == 4, (p, d)
        first_arrived, last_computed = d["layer_arrived"][0], p["layer_stored"][-1]
        assert p["allocated"] < first_arrived < p["kv_sent"] + 1.0
        wins.append(first_arrived < last_computed)
        print(f"{transport}: layer 0 arrived {1000 * (last_computed - first_arrived):.1f} ms before the last layer was computed; "
              f"layers computed at +{[round(1000 * (t - p['allocated']), 1) for t in p['layer_stored']]} ms, "
              f"arrived at +{[round(1000 * (t - p['allocated']), 1) for t in d['layer_arrived']]} ms after allocation")
        if wins[-1]:
            break
    assert any(wins), "decode never had layer 0 before prefill finished its last layer"
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings


def test_overlap_off_sends_nothing_before_the_last_layer(procs):
    """--no-layerwise-push (the comparison baseline): no layer reaches decode before prefill's last layer."""
    from pdserve.protos import generate_pb2 as gpb
    import grpc
    from pdserve.protos import generate_pb2_grpc as gpb_grpc

    decode = start_decode(procs, "tcp", num_blocks=64, name="decode")
    wait_ready(decode)
    prefill = start_prefill(procs, [decode.grpc_address], "tcp", num_blocks=64, extra=("--no-layerwise-push",))
    wait_ready(prefill)
    prompt = [256] + [97 + i % 26 for i in range(999)]
    with grpc.insecure_channel(f"127.0.0.1:{prefill.grpc_port}") as ch:
        tokens = [t for r in gpb_grpc.GeneratorStub(ch).Generate(
            gpb.GenerateRequest(prompt_token_ids=prompt, max_tokens=4, temperature=0, request_id="off"), timeout=120)
            for t in r.token_ids]
    assert len(tokens) == 4
    p = get_json(f"{prefill.url}/debug/requests/off")[1]
    d = get_json(f"{decode.url}/debug/requests/off")[1]
    assert len(d["layer_arrived"]) == 4
    assert min(d["layer_arrived"]) > p["layer_stored"][-1]
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings
