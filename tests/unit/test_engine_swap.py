"""Swap (engine/swap.py): a running request's KV evicted to host memory and restored, with the
engine's own steps in between. Greedy tokens equal a run without eviction; blocks free while
swapped; an abort while swapped drops the host copy; a restore without free blocks waits."""

import pytest
import torch

from harness.engine_runs import run_all
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams

BS = 4
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _engine(tiny, num_blocks=64):
    return LLMEngine(tiny, EngineConfig(num_blocks=num_blocks, block_size=BS))


def _prompts(tiny):
    tok = tiny.tokenizer
    return {"a": (tok.encode("A long answer about tea, please."), GREEDY),
            "b": (tok.encode("Batch job: list every prime."), GREEDY)}


def _drain(engine, got, steps=None):
    n = 0
    while engine.has_unfinished() and (steps is None or n < steps):
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        n += 1


def test_evicted_and_restored_request_gives_the_same_tokens_and_frees_its_blocks(tiny):
    prompts = _prompts(tiny)
    expected = run_all(_engine(tiny), prompts)
    engine, got = _engine(tiny), {}
    for rid, (ids, sp) in prompts.items():
        engine.add_request(rid, ids, sp)
    _drain(engine, got, steps=5)
    free_before = engine.num_free_blocks()
    held = len(engine.scheduler.seqs["b"].block_table)
    moved = engine.swapper.evict("b")
    assert moved == held * engine.kv_cache.num_layers * engine.kv_cache.block_nbytes
    assert engine.num_free_blocks() == free_before + held
    assert engine.swapper.swapped_ids() == ["b"] and engine.num_requests() == 2
    with pytest.raises(ValueError, match="not running"):
        engine.swapper.evict("b")
    _drain(engine, got, steps=6)  # "a" goes on alone; "b" makes no progress while swapped
    progress = len(got["b"])
    _drain(engine, got, steps=3)
    assert len(got["b"]) == progress
    # the blocks "b" left behind were reused meanwhile: scribble over every free one to be sure
    engine.kv_cache.tensor.index_fill_(1, torch.tensor(list(engine.block_manager._free)), 7.0)
    assert engine.swapper.restore("b")
    assert engine.swapper.swapped_ids() == [] and engine.swapper.swapped_bytes() == 0
    _drain(engine, got)
    assert got == expected
    assert engine.num_free_blocks() == engine.num_blocks and engine.num_requests() == 0


def test_abort_while_swapped_and_restore_without_room(tiny):
    prompts = _prompts(tiny)
    engine, got = _engine(tiny, num_blocks=16), {}
    ids, sp = prompts["b"]
    engine.add_request("b", ids, sp)
    _drain(engine, got, steps=3)
    n = len(engine.scheduler.seqs["b"].block_table)
    engine.swapper.evict("b")
    hog = engine.block_manager.allocate([], (engine.num_blocks - n + 1) * BS, use_prefix_cache=False)[0]
    assert not engine.swapper.restore("b")  # its blocks are not free now: it stays swapped, nothing changed
    assert engine.swapper.swapped_ids() == ["b"] and engine.num_free_blocks() == n - 1
    engine.block_manager.free(hog)
    assert engine.abort("b")
    assert engine.swapper.swapped_ids() == [] and engine.swapper.swapped_bytes() == 0
    assert engine.num_free_blocks() == engine.num_blocks and engine.num_requests() == 0
