"""``--engine sim`` through real processes: a sim prefill and a sim decode on loopback (the shipped
``cpu-small`` profile, the byte-level tokenizer).

- mixed greedy requests over gRPC and the OpenAI endpoint give exactly a colocated SimEngine's tokens
  (the sim's tokens are a function of the context, so P/D must not change them);
- every request went through the decode and its KV moved (CacheStore frames, transfer bytes);
- afterwards KV blocks, Sessions and CacheStore entries are back to zero on both processes;
- each process stays small: no torch is loaded (its RSS, printed, well under a torch process's).
"""

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness.conversations import generate
from harness.pd_cluster import (get_json, metric, nothing_held, post_json, start_decode, start_prefill,
                                wait_all_released, wait_ready)
from harness.procs import ProcessGroup

pytestmark = pytest.mark.slow

NUM_BLOCKS = 64
SIM = ["--engine", "sim", "--sim-profile", "cpu-small"]
RSS_BOUND_MIB = 150  # measured about 75 MiB a process (2026-12-06); a torch process starts above 300


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    group = ProcessGroup(log_dir=tmp_path_factory.mktemp("pd-sim") / "logs")
    try:
        decode = start_decode(group, "tcp", NUM_BLOCKS, extra=SIM)
        wait_ready(decode)
        prefill = start_prefill(group, [decode.grpc_address], "tcp", NUM_BLOCKS, extra=SIM)
        wait_ready(prefill)
        yield {"prefill": prefill, "decode": decode}
    finally:
        group.close()


def colocated(prompts: dict[str, list[int]], lengths: dict[str, int]) -> dict[str, list[int]]:
    """Greedy tokens of a colocated SimEngine (no sleeping) with the same profile."""
    from pdserve.engine import EngineConfig, SamplingParams
    from pdserve.engine.sim.engine import SimEngine
    from pdserve.engine.sim.profile import load_profile
    from pdserve.engine.tokenizer import ByteTokenizer

    engine = SimEngine(load_profile("cpu-small"), ByteTokenizer(), EngineConfig(num_blocks=4 * NUM_BLOCKS),
                       sleep=lambda s: None)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=lengths[rid], temperature=0, ignore_eos=True))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


def test_pd_tokens_equal_the_colocated_sim_and_kv_moved(cluster):
    prefill, decode = cluster["prefill"], cluster["decode"]
    rng = random.Random(5)
    prompts = {f"sim-{i}": [256] + [rng.randrange(1, 256) for _ in range(rng.choice([0, 4, 63, 64, 130, 300]))]
               for i in range(10)}
    lengths = {rid: rng.choice([1, 2, 9, 24]) for rid in prompts}
    expected = colocated(prompts, lengths)
    sent_before = metric(prefill.url, "pdserve_kv_transfer_bytes_total")
    with ThreadPoolExecutor(4) as pool:
        got = dict(zip(prompts, pool.map(lambda rid: generate(prefill, rid, prompts[rid], lengths[rid]), prompts)))
    for rid in prompts:
        assert got[rid] == expected[rid], f"{rid} ({len(prompts[rid])} prompt tokens) differs from the colocated sim"
    assert get_json(prefill.url + "/health")[1]["local_requests"] == 0  # every request went through the decode
    assert get_json(decode.url + "/health")[1]["cachestore"]["frames_received"] > 0
    # every prompt block of every layer moved once (random prompts: nothing to reuse): 2 (K, V) x 64 tokens x
    # 4 KV heads x 32 float32 values x 8 layers a block (the profile's shape)
    moved = metric(prefill.url, "pdserve_kv_transfer_bytes_total") - sent_before
    assert moved == sum(-(-len(ids) // 64) for ids in prompts.values()) * 2 * 64 * 4 * 32 * 4 * 8, moved
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings


def test_openai_text_equals_the_colocated_sim(cluster):
    from pdserve.engine.tokenizer import ByteTokenizer

    prefill = cluster["prefill"]
    prompt = "The simulated engine answers "
    status, body = post_json(prefill.url + "/v1/completions",
                             {"model": "tiny", "prompt": prompt, "max_tokens": 20, "temperature": 0})
    assert status == 200, body
    tokenizer = ByteTokenizer()
    expected = tokenizer.decode(colocated({"t": tokenizer.encode(prompt)}, {"t": 20})["t"])
    assert body["choices"][0]["text"] == expected
    assert body["usage"]["completion_tokens"] == 20  # the sim never ends a request by EOS
    assert nothing_held(wait_all_released([prefill, cluster["decode"]]))


def test_a_sim_server_stays_small(cluster):
    rss = {name: _rss_mib(server.proc.pid) for name, server in cluster.items()}
    print(f"sim server RSS: {', '.join(f'{n} {v:.1f} MiB' for n, v in rss.items())}")
    assert all(v < RSS_BOUND_MIB for v in rss.values()), rss


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


KV_SCALE, LINK_GBPS = 8, 0.05  # a scaled payload over a slow modelled link: 6.25 MB of real KV bytes a second


def test_scaled_payload_waits_the_modelled_link(tmp_path):
    """--sim-kv-scale 8 --sim-link-gbps 0.05: the CacheStore moves 1/8 of the real bytes, the request waits the
    modelled time of the real ones, and its tokens are the colocated sim's still."""
    import time

    group = ProcessGroup(log_dir=tmp_path / "logs")
    scaled = [*SIM, "--sim-kv-scale", str(KV_SCALE)]
    try:
        decode = start_decode(group, "tcp", NUM_BLOCKS, extra=scaled)
        wait_ready(decode)
        prefill = start_prefill(group, [decode.grpc_address], "tcp", NUM_BLOCKS,
                                extra=[*scaled, "--sim-link-gbps", str(LINK_GBPS), "--sim-link-latency-us", "1000"])
        wait_ready(prefill)
        ids = [256] + [random.Random(9).randrange(1, 256) for _ in range(4 * 64 - 1)]  # 4 blocks
        real_bytes = 4 * 2 * 64 * 4 * 32 * 4 * 8  # cpu-small's shape: 2 MiB
        start = time.monotonic()
        got = generate(prefill, "scaled-0", ids, 3)
        elapsed = time.monotonic() - start
        assert got == colocated({"scaled-0": ids}, {"scaled-0": 3})["scaled-0"]
        assert metric(prefill.url, "pdserve_kv_transfer_bytes_total") == real_bytes // KV_SCALE
        modelled = real_bytes * 8 / (LINK_GBPS * 1e9)  # 0.34 s: far above the loopback's own time
        assert elapsed >= modelled, (elapsed, modelled)
        assert nothing_held(wait_all_released([prefill, decode]))
    finally:
        group.close()
