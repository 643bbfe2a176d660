"""Decode-side prefix reuse in the engine: ``reserve_prefix`` (the leading blocks come from the
decode's prefix cache, pinned by the reservation) and ``prefill_reserved`` (the decode computes
the prompt's missing KV itself). Greedy tokens equal the colocated engine's, reuse on or off."""

import pytest

from harness.engine_runs import last_moved, run_all, run_pd
from pdserve.engine import EngineConfig, LLMEngine, OutOfBlocksError, SamplingParams, blocks_needed

BS = 4
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _engine(tiny, num_blocks=64):
    return LLMEngine(tiny, EngineConfig(num_blocks=num_blocks, block_size=BS))


def _turns(tiny):
    """A two-turn conversation: turn 2's prompt is turn 1's prompt + answer + a new question."""
    tok = tiny.tokenizer
    turn1 = tok.encode("System: be brief. User: what is a cat?")
    answer = run_all(_engine(tiny), {"t1": (turn1, GREEDY)})["t1"]
    return turn1, turn1 + answer + tok.encode(" User: and a dog?")


def _local(decode, rid, ids, sp):
    """prefill_reserved after reserve_prefix: every token comes out of the decode's steps."""
    _, cached = decode.pd.reserve_prefix(rid, ids, sp.max_tokens)
    decode.pd.prefill_reserved(rid, ids, sp)
    got = []
    while decode.has_unfinished():
        for o in decode.step():
            got += o.new_token_ids
    return got, cached


def test_second_turn_reuses_the_decode_prefix_and_moves_only_new_blocks(tiny):
    turn1, turn2 = _turns(tiny)
    expected = run_all(_engine(tiny), {"t2": (turn2, GREEDY)})["t2"]
    prefill, decode = _engine(tiny), _engine(tiny)
    run_pd(prefill, decode, {"t1": (turn1, GREEDY)}, reuse=True)
    assert last_moved["t1"] == blocks_needed(len(turn1), BS)  # a cold decode holds nothing
    got = run_pd(_engine(tiny), decode, {"t2": (turn2, GREEDY)}, reuse=True)  # a prefill that never saw turn 1
    # the decode kept turn 1's prompt AND its answer (computed by its own decode steps)
    held = (len(turn1) + GREEDY.max_tokens - 1) // BS
    assert last_moved["t2"] == blocks_needed(len(turn2), BS) - held
    assert got["t2"] == expected
    off = run_pd(_engine(tiny), _engine(tiny), {"t2": (turn2, GREEDY)}, reuse=False)
    assert off["t2"] == expected and last_moved["t2"] == blocks_needed(len(turn2), BS)
    assert decode.num_free_blocks() == decode.num_blocks and decode.num_requests() == 0


def test_local_prefill_on_the_decode_equals_colocated(tiny):
    turn1, turn2 = _turns(tiny)
    expected = run_all(_engine(tiny), {"t2": (turn2, GREEDY)})["t2"]
    decode = _engine(tiny)
    got, cached = _local(decode, "cold", turn2, GREEDY)  # nothing cached: the whole prompt here
    assert cached == 0 and got == expected
    run_pd(_engine(tiny), decode, {"t1": (turn1, GREEDY)}, reuse=True)
    got, cached = _local(decode, "warm", turn2, GREEDY)
    assert cached > len(turn1) // BS * BS and got == expected
    assert decode.num_free_blocks() == decode.num_blocks and decode.num_requests() == 0


def test_reserved_prefix_is_pinned_until_the_request_ends(tiny):
    turn1, turn2 = _turns(tiny)
    decode = _engine(tiny, num_blocks=24)
    run_pd(_engine(tiny), decode, {"t1": (turn1, GREEDY)}, reuse=True)
    cached_before = decode.block_manager.num_cached_blocks()
    table, cached = decode.pd.reserve_prefix("t2", turn2, 2)
    reused = table[: cached // BS]
    assert reused and all(decode.block_manager.ref_count(b) == 1 for b in reused)
    # fill the pool: the reused blocks are not free, so no allocation can evict them
    filler, _ = decode.block_manager.allocate([], decode.num_free_blocks() * BS, use_prefix_cache=False)
    with pytest.raises(OutOfBlocksError):
        decode.pd.reserve("other", 1, 1)
    assert decode.block_manager.match_prefix(turn2)[: len(reused)] == reused
    decode.block_manager.free(filler)  # the unpinned cached blocks were evicted by the filler
    assert decode.block_manager.num_cached_blocks() < cached_before
    decode.abort("t2")  # the reservation ends: its prefix goes back to the cache, nothing is held
    assert decode.num_free_blocks() == decode.num_blocks and decode.num_requests() == 0
    assert decode.block_manager.match_prefix(turn2)[: len(reused)] == reused


def test_a_prompt_that_does_not_match_the_reused_prefix_is_refused(tiny):
    turn1, turn2 = _turns(tiny)
    decode = _engine(tiny)
    run_pd(_engine(tiny), decode, {"t1": (turn1, GREEDY)}, reuse=True)
    _, cached = decode.pd.reserve_prefix("t2", turn2, 4)
    assert cached > 0
    other = [t + 1 for t in turn2]
    for call in (lambda: decode.pd.add_prefilled("t2", other, 5, GREEDY),
                 lambda: decode.pd.prefill_reserved("t2", other, GREEDY)):
        with pytest.raises(ValueError, match="does not start with"):
            call()
    assert decode.num_requests() == 1  # still reserved; abort frees it
    decode.abort("t2")
    assert decode.num_free_blocks() == decode.num_blocks and decode.num_requests() == 0
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decode.pd.reserve_prefix("bad", [10**9], 4)
    assert decode.num_requests() == 0


def test_prefill_counters_count_computed_tokens_only(tiny):
    turn1, _ = _turns(tiny)
    prefill = _engine(tiny)
    assert prefill.pd.prefill_counters == (0, 0.0)
    prefill.pd.prefill_only("a", turn1, GREEDY)
    prefill.pd.release("a")
    tokens, seconds = prefill.pd.prefill_counters
    assert tokens == len(turn1) and seconds > 0
    prefill.pd.prefill_only("b", turn1, GREEDY)  # all but the last block come from its prefix cache
    prefill.pd.release("b")
    cached = (len(turn1) - 1) // BS * BS
    assert prefill.pd.prefill_counters[0] == tokens + len(turn1) - cached
