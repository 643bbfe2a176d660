"""Prefix hits from the KV tiers in a real engine (tiny model): a prompt whose prefix was pushed
out of the pool into host memory or onto disk gets it copied back, and the greedy tokens equal
recomputing it (a fresh engine without tiers), on the colocated path, on the prefill path
(prefill_only) and on the decode path (reserve_prefix + prefill_reserved)."""

import os

import pytest

from harness.engine_runs import run_all
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams

BS = 4
POOL = 16  # blocks: one ~40-token conversation and its answer fill most of it
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _engine(tiny, tmp_path=None, host_blocks=0, disk_blocks=0):
    probe = LLMEngine(tiny, EngineConfig(num_blocks=1, block_size=BS))
    per_block = probe.kv_cache.block_nbytes * probe.kv_cache.num_layers
    return LLMEngine(tiny, EngineConfig(num_blocks=POOL, block_size=BS, kv_host_tier_bytes=host_blocks * per_block,
                                        kv_disk_tier_dir=str(tmp_path) if disk_blocks else None,
                                        kv_disk_tier_bytes=disk_blocks * per_block))


def _prompts(tiny):
    """The conversation to come back to, and two others that push it out of the pool."""
    tok = tiny.tokenizer
    first = tok.encode("System: be brief. User: tell me of cats.")
    others = [tok.encode(f"System: a poet {i}. User: write of the sea!") for i in range(2)]
    return first, others


def _push_out(engine, others):
    for i, ids in enumerate(others):
        run_all(engine, {f"other{i}": (ids, GREEDY)})


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_colocated_hit_from_tier_equals_recompute(tiny, tmp_path, tier):
    first, others = _prompts(tiny)
    follow = first + [5, 6, 7, 8, 9]
    expected = run_all(_engine(tiny), {"f": (follow, GREEDY)})["f"]
    engine = _engine(tiny, tmp_path, host_blocks=64 if tier == "host" else 1, disk_blocks=64 if tier == "disk" else 0)
    run_all(engine, {"first": (first, GREEDY)})
    _push_out(engine, others)
    assert engine.tier_stats()[tier].blocks >= len(first) // BS - 2  # most of the prefix left the pool
    got = run_all(engine, {"f": (follow, GREEDY)})["f"]
    assert got == expected
    stats = engine.tier_stats()
    assert stats[tier].hits >= len(first) // BS - 2, f"the prefix did not come back from the {tier} tier: {stats}"
    assert engine.prefix_hit_tokens() >= stats[tier].hits * BS
    assert engine.num_free_blocks() == POOL and engine.num_requests() == 0
    engine.close()
    if tier == "disk":
        assert os.listdir(tmp_path) == []


def test_prefill_and_decode_paths_hit_from_tiers(tiny, tmp_path):
    first, others = _prompts(tiny)
    follow = first + [11, 12, 13]
    expected = run_all(_engine(tiny), {"f": (follow, GREEDY)})["f"]
    # prefill side: prefill_only reuses the tiered prefix and gives the same first token
    prefill = _engine(tiny, tmp_path / "p", host_blocks=2, disk_blocks=64)
    for i, ids in enumerate([first, *others]):
        prefill.pd.prefill_only(f"p{i}", ids, GREEDY)
        prefill.pd.release(f"p{i}")
    computed_before, hit_before = prefill.pd.prefill_counters[0], prefill.prefix_hit_tokens()
    assert prefill.pd.prefill_only("pf", follow, GREEDY) == expected[0]
    prefill.pd.release("pf")
    stats = prefill.tier_stats()
    reused = prefill.prefix_hit_tokens() - hit_before
    assert stats["disk"].hits > 0 and reused >= (stats["disk"].hits + stats["host"].hits) * BS
    assert prefill.pd.prefill_counters[0] - computed_before == len(follow) - reused  # the tier blocks were not computed
    # decode side: reserve_prefix restores the prefix, prefill_reserved computes the rest
    decode = _engine(tiny, tmp_path / "d", host_blocks=64)
    for i, ids in enumerate([first, *others]):
        run_all(decode, {f"d{i}": (ids, GREEDY)})
    _, cached = decode.pd.reserve_prefix("df", follow, GREEDY.max_tokens)
    assert cached >= decode.tier_stats()["host"].hits * BS > 0
    decode.pd.prefill_reserved("df", follow, GREEDY)
    got = []
    while decode.has_unfinished():
        for o in decode.step():
            got += o.new_token_ids
    assert got == expected
    for engine in (prefill, decode):
        assert engine.num_free_blocks() == POOL and engine.num_requests() == 0
        engine.close()

