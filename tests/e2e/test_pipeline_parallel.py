"""Pipeline parallelism: 2 real stage processes over gloo give the one-process engine's tokens,
under both schedules (mixed batching and TD-Pipe), with preemption forced by a small KV pool."""

import random

import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, load_model
from pdserve.batch.pipeline.engine import PipelineConfig, PipelineEngine

NUM_BLOCKS, BLOCK_SIZE = 24, 16


def _requests():
    rng = random.Random(0)
    reqs = []
    for i in range(16):
        ids = [rng.randrange(3, 250) for _ in range(rng.randint(3, 90))]
        if i % 6 == 5:  # seeded sampling: the same draws per position in both engines
            sp = SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.8, top_k=20, seed=100 + i, ignore_eos=True)
        else:
            sp = SamplingParams(max_tokens=rng.randint(1, 24), temperature=0, ignore_eos=True)
        reqs.append((f"r{i}", ids, sp))
    return reqs


def _one_process(reqs):
    torch.set_num_threads(1)
    eng = LLMEngine(load_model("tiny"), EngineConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=16,
                                                     max_num_batched_tokens=128, enable_prefix_cache=False))
    for rid, ids, sp in reqs:
        eng.add_request(rid, ids, sp)
    out = {}
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert eng.num_preemptions > 0  # the pool is small enough to force recomputation
    return out


def test_two_stages_give_the_one_process_tokens():
    reqs = _requests()
    expected = _one_process(reqs)
    cfg = PipelineConfig(num_stages=2, schedule="mixed", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                         max_num_seqs=16, max_num_batched_tokens=128)
    with PipelineEngine("tiny", cfg) as eng:
        # td-pipe twice more: 3 micro-batches in flight; decode tails merged below 4 sequences
        for schedule, depth, min_batch in (("mixed", 0, 1), ("td-pipe", 0, 1), ("td-pipe", 3, 1), ("td-pipe", 0, 4)):
            eng.config.micro_batches, eng.config.min_decode_batch = depth, min_batch
            eng.set_schedule(schedule)
            for rid, ids, sp in reqs:
                eng.add_request(rid, ids, sp)
            out = eng.run()
            got = {rid: o.new_token_ids for rid, o in out.items()}
            assert got == expected, (schedule, depth, min_batch)
            assert all(o.finished and o.finish_reason == "length" for o in out.values())
            # nothing leaks: every block free, no request state left
            assert eng.block_manager.num_free_blocks() == NUM_BLOCKS
            assert not eng.seqs and not eng.ready and not eng.waiting and not eng.in_flight
        assert eng.num_preemptions > 0
        kinds = {b[2] for b in eng.batches}
        assert kinds == {0, 1, 2}  # td-pipe sent prefill-only and decode-only, mixed sent mixed ones
    assert len(eng.stage_traces) == 2 and all(len(t) == len(eng.batches) for t in eng.stage_traces)
    assert all(not p.is_alive() for p in eng.procs)


def test_bad_configuration_is_a_clear_error():
    with pytest.raises(ValueError, match="schedule must be one of"):
        PipelineConfig(schedule="fifo")
    with pytest.raises(ValueError, match="num_stages must be between 1 and the model's 4 layers"):
        PipelineEngine("tiny", PipelineConfig(num_stages=5))
    with pytest.raises(ValueError, match="neither a built-in model"):
        PipelineEngine("/no/such/model", PipelineConfig())
