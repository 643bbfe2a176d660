"""The trace-routing experiment's workload (bench/experiments/trace_workload.py): conversations are kept
or dropped whole and the same in every run, the replay spans the asked duration and names its scaling,
and the reuse ceiling counts what one cache and round robin's caches would hit; the arms use only the
router's own policies."""

import json

import pytest

from pdserve.bench.experiments.trace_routing import ARMS
from pdserve.bench.experiments.trace_workload import (build_workload, conversation_key, reuse_ceiling,
                                                      sample_conversations)
from pdserve.bench.loadgen_workload import RequestSpec
from pdserve.bench.trace_replay import TraceRequest

POOL = list(range(1, 256))


def _conversations(n: int) -> list[TraceRequest]:
    """n conversations of 3 turns each (block 0 shared by all), interleaved in time."""
    out = []
    for turn in range(3):
        for c in range(n):
            ids = (0, 1000 + c, *range(10_000 * (c + 1), 10_000 * (c + 1) + turn))
            out.append(TraceRequest(float(turn * n + c), 512 * len(ids), 10, ids))
    return out


def test_sampling_keeps_or_drops_whole_conversations_the_same_every_time():
    reqs = _conversations(200)
    kept = sample_conversations(reqs, 0.3, seed=5)
    keys = {conversation_key(r, 0) for r in kept}
    assert 30 < len(keys) < 90  # about 60 of 200
    assert all(sum(1 for r in kept if conversation_key(r, 0) == k) == 3 for k in keys)  # every turn of each
    assert kept == sample_conversations(reqs, 0.3, seed=5)
    assert kept != sample_conversations(reqs, 0.3, seed=6)
    assert sample_conversations(reqs, 1.0) == reqs
    assert [r.time_s for r in kept] == sorted(r.time_s for r in kept)


def test_requests_with_fewer_than_two_ids_are_their_own_conversation():
    a, b = TraceRequest(0.0, 10, 1, (7,)), TraceRequest(1.0, 10, 1, ())
    assert conversation_key(a, 0) != conversation_key(a, 1) and conversation_key(b, 3) == ("request", 3)


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_bad_sample_fractions_are_refused(fraction):
    with pytest.raises(ValueError):
        sample_conversations(_conversations(2), fraction)


def test_the_replay_spans_the_duration_and_names_its_scaling(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": int(r.time_s * 1000), "input_length": r.input_length,
                                        "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
                            for r in _conversations(40)))
    w = build_workload(path, "mooncake", fraction=0.5, duration_s=12.0, length_scale=0.125, pool=POOL,
                       max_prompt_tokens=200, max_output_tokens=4, seed=1)
    assert w.arrivals[0] == 0.0 and w.arrivals[-1] == pytest.approx(12.0)
    assert w.max_prompt_tokens <= 200 and w.max_output_tokens <= 4
    text = w.describe()
    assert f"{len(w.specs)} requests" in text and "sampled x0.5 (seed 1)" in text and "lengths x0.125" in text
    assert "time x" in text and "a hash id = 64 tokens" in text
    with pytest.raises(ValueError):
        build_workload(path, "mooncake", fraction=0.5, duration_s=0.0, length_scale=0.125, pool=POOL)


def test_the_reuse_ceiling_counts_one_cache_and_round_robin_caches():
    a, b = tuple(range(1, 9)), tuple(range(20, 28))
    prompts = [a + b,      # 0: nothing cached yet
               a + b + a,  # 1: extends 0; round robin put 0 on the other prefill
               a + b + b]  # 2: extends 0, same prefill as 0 under round robin
    specs = [RequestSpec(len(p), 1, prompt_ids=p) for p in prompts]
    c = reuse_ceiling(specs, n_prefills=2, block_size=4)
    total = 16 + 24 + 24
    assert c["one_cache"] == pytest.approx((16 + 16) / total)  # requests 1 and 2 reuse request 0's 4 blocks
    assert c["round_robin"] == pytest.approx(16 / total)        # only request 2 lands where request 0 did
    assert c["computed_ratio_bound"] == pytest.approx((total - 32) / (total - 16))
    assert reuse_ceiling(specs, 1, 4)["round_robin"] == c["one_cache"]
    with pytest.raises(ValueError):
        reuse_ceiling(specs, 0, 4)


def test_the_arms_use_only_the_routers_own_policies():
    from pdserve.router.router import Router

    assert set(ARMS) == {"round-robin", "least-loaded", "prefix"}
    for flags in ARMS.values():
        assert flags[flags.index("--policy") + 1] in Router.POLICIES
