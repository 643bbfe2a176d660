"""Remote prefills waiting for their grant in the one Scheduler (engine/remote_prefill.py, engine/scheduler.py):
a prompt whose KV has nowhere to go yet keeps its place in line and is never computed before ``grant``; the
Scheduler asks for it (``want``, once) when a step reaches it, when the step before expects the next one to
admit it (one step's budget ahead, no further), or when it is short enough to pass a long prompt part-way.
Through the engine (``engine.pd``): granted prompts are computed and pushed exactly as before, an aborted one
leaves nothing behind."""

import asyncio

import pytest

from pdserve.engine import AsyncLLMEngine, EngineConfig, LLMEngine
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.remote_prefill import PrefillAborted, RemotePrefill
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence

SP = SamplingParams(max_tokens=4, temperature=0)


def _remote(rid: str, n: int, arrival: int, asked: list[str], granted: bool = False) -> Sequence:
    seq = Sequence(rid, list(range(3, 3 + n)), SP, arrival)
    seq.remote = RemotePrefill(None, None, want=lambda: asked.append(rid), granted=granted)
    return seq


def _scheduler(budget=32, threshold=0, num_blocks=64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 4, enable_prefix_cache=False), 8, budget, threshold)


def _ids(seqs) -> list[str]:
    return [s.request_id for s in seqs]


def test_an_ungranted_prompt_keeps_its_place_is_asked_once_and_never_computed_before_its_grant():
    s, asked = _scheduler(), []
    s.add(_remote("a", 8, 0, asked))
    s.add(_remote("b", 8, 1, asked, granted=True))
    step = s.schedule()
    assert _ids(step) == ["b"] and asked == ["a"]  # a waits for its decode; b (granted) goes meanwhile
    assert _ids(s.waiting) == ["a"] and s.seqs["a"].block_table == []  # nothing taken for it
    s.hold_prefilled(s.seqs["b"])  # b computed (the engine's part)
    assert s.schedule() == [] and asked == ["a"]  # still not computed, and asked once only
    s.seqs["a"].remote.granted = True
    assert [(q.request_id, q.num_new) for q in s.schedule()] == [("a", 8)]


def test_the_step_before_asks_for_what_the_next_step_may_admit_and_no_further():
    s, asked = _scheduler(budget=32), []
    for i in range(6):
        s.add(_remote(f"p{i}", 12, i, asked, granted=i == 0))
    step = s.schedule()
    # p0 (granted) computes now; p1 and p2 would fill this step's budget after it but are not granted: asked.
    # After this step nothing is left of p0, so the next step may admit 32 tokens of the line: p1, p2, p3
    # (36 tokens reach past the budget: p3 starts within it); p4 and p5 lie beyond one step's budget: not asked.
    assert _ids(step) == ["p0"]
    assert asked == ["p1", "p2", "p3"], asked


def test_a_long_prompt_part_way_holds_back_asks_for_the_line_but_a_short_one_that_may_pass_is_asked():
    s, asked = _scheduler(budget=32, threshold=16), []
    s.add(_remote("long", 200, 0, asked, granted=True))
    assert _ids(s.schedule()) == ["long"] and s.seqs["long"].num_new == 32
    s.seqs["long"].num_computed, s.seqs["long"].num_new = 32, 0
    s.add(_remote("mid", 40, 1, asked))  # too long to pass a chunk: waits for the long one
    s.add(_remote("short", 8, 2, asked))  # fits beside a 16-token chunk: may pass once granted
    step = s.schedule()
    assert _ids(step) == ["long"] and s.seqs["long"].num_new == 32  # short not granted: the long one's whole budget
    assert asked == ["short"]  # 168 tokens of the long prompt lie ahead of mid: not asked yet
    s.seqs["long"].num_computed, s.seqs["long"].num_new = 64, 0
    s.seqs["short"].remote.granted = True
    step = s.schedule()
    assert [(q.request_id, q.num_new) for q in step] == [("long", 16), ("short", 8)]  # it passes now


def test_through_the_engine_a_granted_remote_prefill_computes_as_before_and_an_aborted_one_leaves_nothing(tiny):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=64, block_size=4))
    prompt = tiny.tokenizer.encode("a prompt whose decode is slow to answer " * 3)
    first = engine.pd.prefill_many([("plain", prompt, SP)])["plain"]  # the same prompt, never gated
    engine.pd.release("plain")
    asked, done, layers = [], {}, []

    def on_done(rid):
        return lambda token, error: done.setdefault(rid, (token, error))

    engine.pd.add_remote("r1", prompt, SP, lambda layer, blocks, at: layers.append(layer), on_done("r1"),
                         want=lambda: asked.append("r1"))
    engine.pd.add_remote("r2", prompt[::-1], SP, None, on_done("r2"), want=lambda: asked.append("r2"))
    engine.step()
    assert sorted(asked) == ["r1", "r2"] and not layers and not done  # both asked, nothing computed
    assert engine.num_free_blocks() == engine.num_blocks
    assert engine.pd.grant("r1") and engine.abort("r2")
    assert not engine.pd.grant("r2")  # gone: nothing to grant
    while "r1" not in done:
        engine.step()
    assert done["r1"] == (first, None)  # the same first token as the prompt never gated
    assert set(layers) == set(range(tiny.config.num_layers))
    assert isinstance(done["r2"][1], PrefillAborted)  # the abort reported to its caller
    engine.pd.release("r1")
    assert engine.num_free_blocks() == engine.num_blocks and engine.num_requests() == 0


def test_the_async_engine_calls_want_on_the_loop_and_a_cancel_while_ungranted_leaves_nothing(tiny):
    async def main():
        aeng = AsyncLLMEngine(LLMEngine(tiny, EngineConfig(num_blocks=64, block_size=4)))
        await aeng.start()
        try:
            prompt = tiny.tokenizer.encode("asked for, then granted")
            wanted = asyncio.Event()
            task = asyncio.ensure_future(aeng.prefill_only("g", prompt, SP, want=wanted.set))
            await asyncio.wait_for(wanted.wait(), 60)
            assert not task.done()  # not computed before its grant
            assert await aeng.grant("g")
            token = await asyncio.wait_for(task, 60)
            await aeng.release("g")
            never = asyncio.Event()
            left = asyncio.ensure_future(aeng.prefill_only("c", prompt, SP, want=never.set))
            await asyncio.wait_for(never.wait(), 60)
            left.cancel()
            with pytest.raises(asyncio.CancelledError):
                await left
            assert not await aeng.grant("c")  # the cancel aborted it: nothing to grant
            return token, await aeng.stats()
        finally:
            await aeng.stop()

    token, stats = asyncio.run(main())
    assert isinstance(token, int)
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
