"""An FP8 KV cache through real processes (``--kv-cache-dtype fp8`` on every server), both KV
transports: the CacheStore moves fp8 blocks with their per-token scales inside them, layer by layer,
checksummed (on by default here), and

- mixed greedy requests through P/D give exactly the colocated fp8-KV engine's tokens;
- a second turn reuses the decode's cached blocks of the first (decode-side prefix reuse keeps the
  scales: they are in the blocks) and still gives the colocated fp8 tokens;
- a prefill and a decode with different --kv-cache-dtype refuse each other at the Session, the
  reason naming both KV dtypes, in either direction;
- afterwards KV blocks, Sessions and CacheStore entries are back to zero on every process.
"""

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.conversations import BS, MAX_TOKENS, conversation, generate, served_by, wait_index_caught_up
from harness.pd_cluster import (get_json, metric, nothing_held, post_json, start_decode, start_prefill,
                                wait_all_released, wait_ready)
from harness.procs import ProcessGroup

pytestmark = pytest.mark.slow

NUM_BLOCKS = 64
FP8 = ["--kv-cache-dtype", "fp8", "--block-size", str(BS)]


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def cluster(request, tmp_path_factory):
    transport = request.param
    group = ProcessGroup(log_dir=tmp_path_factory.mktemp(f"fp8kv-{transport}") / "logs")
    try:
        decodes = [start_decode(group, transport, NUM_BLOCKS, extra=FP8, name=f"decode{i}") for i in range(2)]
        for d in decodes:
            wait_ready(d)
        prefill = start_prefill(group, [d.grpc_address for d in decodes], transport, NUM_BLOCKS, extra=FP8)
        wait_ready(prefill)
        yield {"transport": transport, "prefill": prefill, "decodes": decodes}
    finally:
        group.close()


def _colocated_fp8(prompts: dict[str, list[int]], max_tokens: dict[str, int]) -> dict[str, list[int]]:
    """The engine alone with an fp8 KV cache, one request at a time, greedy, EOS ignored."""
    import torch

    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, load_model

    torch.set_num_threads(1)
    engine = LLMEngine(load_model("tiny"), EngineConfig(num_blocks=256, block_size=BS, kv_cache_dtype="fp8"))
    out = {}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens[rid], temperature=0, ignore_eos=True))
        out[rid] = []
        while engine.has_unfinished():
            out[rid] += [t for o in engine.step() for t in o.new_token_ids]
    return out


def test_mixed_greedy_requests_equal_the_fp8_engine_alone(cluster):
    rng = random.Random(11)
    prompts, lengths = {}, {}
    for i in range(12):
        n = rng.choice([1, 5, 16, 17, 63, 64, 130, 200])
        prompts[f"{cluster['transport']}-m{i}"] = [256] + [rng.randrange(1, 256) for _ in range(n - 1)]
        lengths[f"{cluster['transport']}-m{i}"] = rng.choice([1, 2, 7, 16, 30])
    expected = _colocated_fp8(prompts, lengths)
    prefill = cluster["prefill"]
    sent_before = metric(prefill.url, "pdserve_kv_transfer_bytes_total")
    with ThreadPoolExecutor(4) as pool:
        got = dict(zip(prompts, pool.map(lambda rid: generate(prefill, rid, prompts[rid], lengths[rid]), prompts)))
    for rid in prompts:
        assert got[rid] == expected[rid], f"{rid} ({len(prompts[rid])} prompt tokens) differs from the fp8 engine alone"
    assert get_json(prefill.url + "/health")[1]["local_requests"] == 0  # every request went through a decode
    frames = [get_json(d.url + "/health")[1]["cachestore"]["frames_received"] for d in cluster["decodes"]]
    assert all(n > 0 for n in frames), f"KV frames received per decode: {frames}"
    # fp8 blocks moved, every prompt block once (random prompts: no prefix to reuse): 2 (K, V) x 16 tokens x
    # 2 KV heads x (16 fp8 bytes + a 2-byte scale) x 4 layers each, where float32 K/V take 16384
    moved = metric(prefill.url, "pdserve_kv_transfer_bytes_total") - sent_before
    assert moved == sum(-(-len(ids) // BS) for ids in prompts.values()) * 2 * BS * 2 * (16 + 2) * 4, moved
    readings = wait_all_released([prefill, *cluster["decodes"]])
    assert nothing_held(readings), readings


def test_second_turn_reuses_the_decodes_fp8_blocks_and_equals_the_engine_alone(cluster):
    prefill, decodes = cluster["prefill"], cluster["decodes"]
    rid = f"{cluster['transport']}-conv"
    turn1, question = conversation(3)
    answer = generate(prefill, f"{rid}-t1", turn1)
    assert answer == _colocated_fp8({"t1": turn1}, {"t1": MAX_TOKENS})["t1"]
    turn2 = turn1 + answer + question
    expected = _colocated_fp8({"t2": turn2}, {"t2": MAX_TOKENS})["t2"]
    wait_index_caught_up(prefill, decodes)
    home = next(d for d in decodes if served_by([d], f"{rid}-t1"))
    before = metric(home.url, "pdserve_kv_prompt_blocks_total", source="reused")
    assert generate(prefill, f"{rid}-t2", turn2) == expected
    assert served_by(decodes, f"{rid}-t2") == [home.name]
    reused = metric(home.url, "pdserve_kv_prompt_blocks_total", source="reused") - before
    assert reused == (len(turn1) + MAX_TOKENS - 1) // BS, reused  # turn 1's prompt and answer, read in place
    readings = wait_all_released([prefill, *decodes])
    assert nothing_held(readings), readings


@pytest.mark.parametrize("prefill_kv,decode_kv", [("auto", "fp8"), ("fp8", "auto")])
def test_different_kv_dtypes_refuse_each_other_naming_both(procs, prefill_kv, decode_kv):
    decode = start_decode(procs, "tcp", NUM_BLOCKS, extra=["--kv-cache-dtype", decode_kv])
    wait_ready(decode)
    prefill = start_prefill(procs, [decode.grpc_address], "tcp", NUM_BLOCKS, extra=["--kv-cache-dtype", prefill_kv])
    wait_ready(prefill)
    status, body = post_json(prefill.url + "/v1/completions", {"model": "tiny", "prompt": [256, 1, 2, 3],
                                                               "max_tokens": 4})
    assert status == 503, body
    message = body["error"]["message"]
    words = {"fp8": "fp8 (float8_e4m3fn + a bfloat16 scale per token per KV head)", "auto": "float32"}
    assert f"decode's KV cache is {words[decode_kv]}, this prefill's is {words[prefill_kv]}" in message, message
    assert f"--kv-cache-dtype: prefill='{prefill_kv}' decode='{decode_kv}'" in message, message
    assert metric(decode.url, "pdserve_kv_allocation_refusals_total", reason="incompatible") >= 1
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings


def test_a_prompt_spanning_three_fp8_decodes_through_the_kv_pool_equals_the_engine_alone(procs):
    """The KV pool inside P/D with fp8 caches: the prefill pushes each part of the prompt's fp8 blocks (scales
    inside) to the decode or the lender holding it; the tokens equal the fp8 engine alone on a pool that holds
    the request; every block, loan, Session and CacheStore entry comes back."""
    import re

    import grpc

    from harness.conditions import wait_until
    from pdserve.net import free_port

    fp8, blocks = ["--kv-cache-dtype", "fp8"], 8  # 512 tokens per decode (blocks of 64), lending up to 7
    gm_port = free_port()
    procs.pdserve("kvpool", "gmanager", "--port", str(gm_port), "--ttl", "2", name="gmanager")
    decodes = [start_decode(procs, "tcp", blocks, name=f"decode{i}", extra=[
        *fp8, "--kv-pool", f"127.0.0.1:{gm_port}", "--kv-pool-port", str(free_port()),
        "--kv-pool-instance-id", f"decode{i}", "--kv-pool-lend-fraction", "0.875"]) for i in range(3)]
    for d in decodes:
        wait_ready(d)
    prefill = start_prefill(procs, [d.grpc_address for d in decodes], "tcp", 64, extra=[*fp8, "--no-resume"])
    wait_ready(prefill)
    rnd = random.Random(0)
    prompt = [rnd.randrange(32, 127) for _ in range(1300)]  # 21 blocks with its 12 tokens: 7 here, 14 borrowed

    def generate_long():
        try:
            return generate(prefill, "long", prompt, 12)
        except grpc.RpcError as err:  # the prefill has not heard of the pool's room yet: "only 8 KV blocks"
            assert re.search(r"the largest decode holds only \d+ KV blocks", err.details()), err.details()
            return None

    got = []
    wait_until(lambda: got.append(generate_long()) or got[-1] is not None, "a decode pooled the long request",
               hang_guard_s=60, pause_s=0.2)
    expected = _colocated_fp8({"long": prompt}, {"long": 12})["long"]
    assert got[-1] == expected
    pools = [get_json(d.url + "/health")[1]["kv_pool"] for d in decodes]
    assert sum(p["pooled_requests_total"] for p in pools) == 1 and sum(p["borrowed_blocks_total"] for p in pools) >= 13
    readings = wait_all_released([prefill, *decodes], timeout=20)
    assert nothing_held(readings), readings
    wait_until(lambda: all(get_json(d.url + "/health")[1]["kv_pool"]["loans"] == 0 for d in decodes),
               "every loan given back", hang_guard_s=30, pause_s=0.1)
