"""Layer-wise overlap is real: decode receives the first layer's KV before prefill has
finished computing its last layer.

Timestamps are CLOCK_MONOTONIC (``time.monotonic``), which all processes of one Linux
machine share. The prefill reports when each layer's KV was written (the engine's layer
callback, right before the CacheStore store); the decode reports when each layer arrived
(its ``CacheStoreReceiver.load`` subscription woke).
"""

import threading

import pytest

from harness.conditions import wait_until
from harness.gates import Gate
from harness.pd_cluster import get_json, nothing_held, start_decode, start_prefill, wait_all_released, wait_ready
from pdserve.test_hooks import LAYER_GATE_ENV

HANG_GUARD_S = 60.0  # only a hang guard: layer 0 crosses loopback in milliseconds

pytestmark = pytest.mark.slow


# the prompt (2000 tokens) computed whole in one step, or in chunks of 512 tokens (a step's budget): 4 steps
CHUNKING = {"whole": (["--max-num-batched-tokens", "4096"], 1),
            "chunked": (["--max-num-batched-tokens", "512"], 4)}


@pytest.mark.parametrize("chunking", sorted(CHUNKING))
@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_first_layer_arrives_before_last_layer_is_computed(procs, transport, chunking, tmp_path):
    """The prefill's engine is held after the last chunk's layer 0 (the test hook ``PDSERVE_TEST_LAYER_GATE``)
    until the decode says layer 0 arrived (every block of it, the earlier chunks' too): with the layer-wise
    push it does, before the last layer is computed, however the box schedules the threads (with the push off
    nothing would arrive: the hang guard fires)."""
    from pdserve.protos import generate_pb2 as gpb
    import grpc
    from pdserve.protos import generate_pb2_grpc as gpb_grpc

    gate = Gate(tmp_path / "layer-gate")  # closed
    decode = start_decode(procs, transport, num_blocks=64, name="decode")
    wait_ready(decode)
    extra, chunks = CHUNKING[chunking]
    prefill = start_prefill(procs, [decode.grpc_address], transport, num_blocks=64, extra=extra,
                            env={LAYER_GATE_ENV: str(gate.directory)})
    wait_ready(prefill)
    prompt = [256] + [97 + i % 26 for i in range(1999)]
    rid = "overlap"

    def generate() -> list:
        with grpc.insecure_channel(f"127.0.0.1:{prefill.grpc_port}") as ch:
            return list(gpb_grpc.GeneratorStub(ch).Generate(
                gpb.GenerateRequest(prompt_token_ids=prompt, max_tokens=2, temperature=0, request_id=rid), timeout=120))

    out: dict = {}

    def run():
        try:
            out["responses"] = generate()
        except Exception as exc:  # noqa: BLE001 - the assertion below shows it
            out["error"] = repr(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    gate.wait_held(1)  # layer 0 computed and handed to the CacheStore; the engine waits before layer 1
    wait_until(lambda: get_json(f"{decode.url}/debug/requests/{rid}")[1].get("layer_arrived"),
               "layer 0 to arrive at the decode while the prefill holds before layer 1", hang_guard_s=HANG_GUARD_S)
    gate.open()
    thread.join(HANG_GUARD_S)
    assert "error" not in out, out
    p = get_json(f"{prefill.url}/debug/requests/{rid}")[1]
    d = get_json(f"{decode.url}/debug/requests/{rid}")[1]
    assert len(p["layer_stored"]) == 4 * chunks and len(d["layer_arrived"]) == 4, (p, d)  # a store per layer per chunk
    first_arrived, last_computed = d["layer_arrived"][0], p["layer_stored"][-1]
    assert p["allocated"] < first_arrived < last_computed, (p, d)
    listed = get_json(f"{prefill.url}/debug/requests")[1]  # every recent request: the same record, in a timeline
    assert [r for r in listed["requests"] if r["request_id"] == rid] == [p], listed
    assert p["arrived"] <= p["start"] <= p["allocated"] < listed["now"], p
    for server in (prefill, decode):  # where each process's CPU went, its engine thread among the rest
        status, threads = get_json(f"{server.url}/debug/threads")
        cpu = [row["cpu_s"] for row in threads["threads"]]
        assert status == 200 and "pdserve-engine" in [row["name"] for row in threads["threads"]], threads
        assert min(cpu) >= 0 and threads["process_cpu_s"] >= sum(cpu) > 0, threads
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
