"""One scheduler, chunked prefill: a prompt computed in chunks gives the tokens (and the KV) of one
computed at once, on every path (colocated, P/D remote prefill, the decode's prefill_reserved);
a remote prefill hands each block of each layer over exactly once, in block order; a short prompt
passes a long one after one of its chunks; nothing is held after an abort or a failure."""

import asyncio

import pytest
import torch

from pdserve.engine import AsyncLLMEngine, EngineConfig, LLMEngine, OutOfBlocksError, SamplingParams
from pdserve.engine.remote_prefill import PrefillAborted
from harness.conditions import settle
from harness.engine_runs import run_all, run_pd

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, top_k=50, seed=99, ignore_eos=True)


def _prompts(tiny):
    tok = tiny.tokenizer
    return [tok.encode("chunked prefill keeps the step short. " * 6), tok.encode("short"),
            tok.encode("a middle sized prompt for the batch " * 2)]


def _engine(tiny, chunk=0, budget=2048, **kw):
    kw.setdefault("num_blocks", 128)
    kw.setdefault("block_size", 4)
    return LLMEngine(tiny, EngineConfig(max_num_batched_tokens=budget, long_prefill_threshold=chunk, **kw))


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_chunked_colocated_equals_whole(tiny, sp):
    requests = {str(i): (p, sp) for i, p in enumerate(_prompts(tiny))}
    whole = run_all(_engine(tiny), requests)
    for chunk, budget in ((8, 2048), (5, 2048), (0, 16)):  # aligned, unaligned, the budget itself
        engine = _engine(tiny, chunk, budget)
        assert run_all(engine, requests) == whole, (chunk, budget)
        assert engine.num_free_blocks() == engine.num_blocks


def test_a_step_never_exceeds_its_budget_and_a_chunk_ends_on_a_block(tiny):
    engine = _engine(tiny, chunk=8, budget=16)
    sizes = []
    real = engine.runner.forward_sample

    def spy(batch, on_layer):
        sizes.append([(s.num_computed, s.num_new, s.num_tokens) for s in batch])
        return real(batch, on_layer)

    engine.runner.forward_sample = spy
    got = run_all(engine, {str(i): (p, GREEDY) for i, p in enumerate(_prompts(tiny))})
    assert got == run_all(_engine(tiny), {str(i): (p, GREEDY) for i, p in enumerate(_prompts(tiny))})
    assert all(sum(n for _, n, _ in step) <= 16 for step in sizes)
    chunks = [(done, n) for step in sizes for done, n, total in step if done + n < total]  # before a prompt's last
    assert len(chunks) > 20 and max(n for _, n in chunks) <= 16
    # each ends on a block boundary, unless it is what was left of the budget and less than a block
    assert all((done + n) % 4 == 0 or n < 4 for done, n in chunks)


def test_remote_prefill_in_chunks_pushes_every_block_of_every_layer_once_in_order(tiny):
    p = _prompts(tiny)[0]
    whole = _engine(tiny)
    first_whole = whole.pd.prefill_only("r", p, GREEDY)
    blocks_whole = whole.pd.prefill_block_ids("r")
    chunked = _engine(tiny, budget=32)  # 229 tokens: 8 chunks
    calls: dict[int, list[tuple[int, list[int]]]] = {}
    kv = chunked.kv_cache

    def on_layer(layer, block_ids, first):
        # the blocks handed over are final for this layer when handed over (equal to the whole prompt's up to
        # float32 rounding: a chunk's attention reads the earlier chunks from the cache)
        want = whole.kv_cache.layer(layer)[blocks_whole[first:first + len(block_ids)]]
        assert torch.allclose(kv.layer(layer)[block_ids], want, atol=1e-5, rtol=1e-4)
        calls.setdefault(layer, []).append((first, list(block_ids)))

    assert chunked.pd.prefill_only("r", p, GREEDY, on_layer=on_layer) == first_whole
    table = chunked.pd.prefill_block_ids("r")
    assert sorted(calls) == list(range(tiny.config.num_layers))
    for layer, parts in calls.items():
        assert len(parts) > 1  # several chunks
        assert [f for f, _ in parts] == [sum(len(b) for _, b in parts[:i]) for i in range(len(parts))]  # in order
        assert [b for _, blocks in parts for b in blocks] == table  # each block once
    for e in (whole, chunked):
        e.pd.release("r")
        assert e.num_free_blocks() == e.num_blocks and e.num_requests() == 0


@pytest.mark.parametrize("reuse", [False, True], ids=["plain", "decode-prefix-reuse"])
def test_pd_with_chunked_prefill_and_chunked_decode_equals_colocated(tiny, reuse):
    requests = {str(i): (p, GREEDY) for i, p in enumerate(_prompts(tiny))}
    colocated = run_all(_engine(tiny), requests)
    prefill, decode = _engine(tiny, budget=32), _engine(tiny, budget=48)
    assert run_pd(prefill, decode, requests, reuse=reuse) == colocated
    assert prefill.num_free_blocks() == prefill.num_blocks and prefill.num_requests() == 0


def test_prefill_reserved_is_chunked_and_equals_colocated(tiny):
    p = _prompts(tiny)[0]
    expected = run_all(_engine(tiny), {"r": (p, GREEDY)})["r"]
    decode = _engine(tiny, budget=8)
    decode.pd.reserve("r", len(p), GREEDY.max_tokens)
    decode.pd.prefill_reserved("r", p, GREEDY)
    got, steps = [], 0
    while decode.has_unfinished():
        steps += 1
        for o in decode.step():
            got += o.new_token_ids
    assert got == expected
    assert steps >= len(p) // 8 + GREEDY.max_tokens - 1  # the prompt took several steps
    assert decode.num_free_blocks() == decode.num_blocks


def test_a_short_prompt_passes_a_long_one_after_one_chunk(tiny):
    """The long prompt is 2k tokens (the tiny model's whole context); alone it takes the whole budget per step;
    the short one arrives after its first chunk and gets its first token in the next step, beside a chunk of
    long_prefill_threshold tokens, while the long one still has chunks to go."""
    long_ids = [(7 * i) % 200 + 5 for i in range(2000)]
    engine = _engine(tiny, chunk=256, budget=512, num_blocks=520)
    engine.add_request("long", long_ids, GREEDY)
    assert engine.step() == []  # its first chunk, the whole budget
    long_seq = engine.scheduler.seqs["long"]
    assert long_seq.num_computed == 512
    engine.add_request("short", _prompts(tiny)[1], GREEDY)
    outs = engine.step()
    assert [o.request_id for o in outs] == ["short"] and outs[0].new_token_ids
    assert long_seq.num_computed == 768  # a chunk of 256 beside the short one: it waited for one chunk
    while engine.has_unfinished():
        engine.step()
    assert engine.num_free_blocks() == engine.num_blocks


def test_two_long_prompts_run_one_after_the_other_and_a_short_one_passes_both(tiny):
    """At most one prompt part-way: the second long prompt waits for the first (interleaved, both would get their
    first token late); a short prompt is admitted beside them whenever it finishes in the step."""
    engine = _engine(tiny, chunk=16, budget=64, num_blocks=256)
    a, b = _prompts(tiny)[0], list(reversed(_prompts(tiny)[0]))
    engine.add_request("a", a, GREEDY)
    engine.add_request("b", b, GREEDY)
    firsts, step = {}, 0
    while len(firsts) < 3:
        step += 1
        assert not (engine.scheduler.seqs["a"].num_computed < len(a)
                    and 0 < engine.scheduler.seqs["b"].num_computed < len(b))  # never both part-way
        if step == 2:
            engine.add_request("short", _prompts(tiny)[1], GREEDY)
        for o in engine.step():
            firsts.setdefault(o.request_id, step)
    assert firsts["short"] == 2 < firsts["a"] < firsts["b"]  # short: beside a (b, long, waits its turn)
    while engine.has_unfinished():
        engine.step()
    assert engine.num_free_blocks() == engine.num_blocks


def test_waiting_order_follows_priority_then_arrival(tiny):
    engine = _engine(tiny, max_num_seqs=1)
    order = []
    for rid, priority in (("c", 2.0), ("a", 1.0), ("b", 1.0), ("d", 0.5)):
        engine.pd.add_remote(rid, _prompts(tiny)[1], GREEDY, on_done=lambda t, e, rid=rid: order.append(rid),
                             priority=priority)
    while engine.has_unfinished():
        engine.step()
        for rid in list(order):
            engine.pd.release(rid)
    assert order == ["d", "a", "b", "c"]
    assert engine.num_free_blocks() == engine.num_blocks and engine.num_requests() == 0


def test_remote_prefill_abort_and_failure_free_everything(tiny):
    engine = _engine(tiny, budget=32)
    heard = {}
    p = _prompts(tiny)[0]
    engine.pd.add_remote("aborted", p, GREEDY, on_done=lambda t, e: heard.setdefault("aborted", e))
    engine.step()  # its first chunk
    assert engine.abort("aborted")
    assert isinstance(heard["aborted"], PrefillAborted)

    def boom(layer, blocks, first):
        if first > 0:
            raise RuntimeError("receiver gone")

    engine.pd.add_remote("failed", p, GREEDY, on_layer=boom, on_done=lambda t, e: heard.setdefault("failed", e))
    engine.add_request("bystander", _prompts(tiny)[1], GREEDY)
    got = []
    while engine.has_unfinished():
        got += [o for o in engine.step() if o.request_id == "bystander"]
    assert str(heard["failed"]) == "receiver gone"
    assert got[-1].finished and got[-1].finish_reason == "length"  # the other request of its steps went on
    with pytest.raises(OutOfBlocksError, match="pool has only"):
        engine.pd.add_remote("huge", [5] * 600, GREEDY)
    assert engine.num_free_blocks() == engine.num_blocks and engine.num_requests() == 0


def test_a_remote_prefill_cancelled_while_its_add_is_queued_leaves_nothing(tiny):
    """Cancelled before the engine thread answered its add (found by CI under load: the request was added after
    the cancel and stayed, waiting, for ever): the abort is queued after the add, so nothing is left."""
    async def main():
        aeng = AsyncLLMEngine(_engine(tiny, num_blocks=64))
        await aeng.start()
        task = asyncio.ensure_future(aeng.prefill_only("c", _prompts(tiny)[0], GREEDY))
        await asyncio.sleep(0)  # the task ran to its first wait: the add is queued, its answer not yet delivered
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = await aeng.stats()
        await aeng.stop()
        return stats

    stats = asyncio.run(main())
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_async_remote_prefill_waits_for_blocks_then_runs_and_cancel_frees(tiny):
    """A remote prefill that finds no free blocks waits in the scheduler (no error, no spin) until a held
    prompt is released; a cancelled wait aborts its request."""
    p = _prompts(tiny)[0]
    other = tiny.tokenizer.encode("no prefix in common with the first one, and as long as it. " * 4)[:len(p)]
    expected = _engine(tiny).pd.prefill_only("b", other, GREEDY)

    async def main():
        engine = _engine(tiny, num_blocks=64)  # one long prompt's 58 blocks at a time
        aeng = AsyncLLMEngine(engine)
        await aeng.start()
        await aeng.prefill_only("a", p, GREEDY)
        second = asyncio.ensure_future(aeng.prefill_only("b", other, GREEDY))
        await settle()  # b's prefill_only has queued its request
        stats = await aeng.stats()
        assert stats["num_waiting"] == 1 and not second.done()
        await aeng.release("a")
        assert await second == expected
        await aeng.release("b")
        third = asyncio.ensure_future(aeng.prefill_only("c", p, GREEDY))
        await aeng.prefill_only("d", _prompts(tiny)[1], GREEDY)  # c is admitted before d (arrival order)
        third.cancel()
        with pytest.raises(asyncio.CancelledError):
            await third
        await aeng.release("d")
        stats = await aeng.stats()
        await aeng.stop()
        return stats

    stats = asyncio.run(main())
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_requests"] == 0


def test_solo_prompts_give_the_same_tokens_and_a_short_one_passes_a_long_one_alone(tiny):
    """EngineConfig.solo_prompt_tokens (the servers' default on a CPU): prompts share a step only up to that many
    tokens; a short prompt arriving while a long one is part-way gets a step of its own, the long one sitting it out."""
    requests = {str(i): (p, GREEDY) for i, p in enumerate(_prompts(tiny))}
    assert run_all(_engine(tiny, 8, 32, solo_prompt_tokens=16), requests) == run_all(_engine(tiny), requests)
    engine = _engine(tiny, chunk=256, budget=512, num_blocks=520, solo_prompt_tokens=64)
    engine.add_request("long", [(7 * i) % 200 + 5 for i in range(2000)], GREEDY)
    assert engine.step() == []  # its first chunk, the whole budget
    long_seq = engine.scheduler.seqs["long"]
    engine.add_request("short", _prompts(tiny)[1], GREEDY)
    outs = engine.step()
    assert [o.request_id for o in outs] == ["short"] and outs[0].new_token_ids
    assert long_seq.num_computed == 512  # it sat the short one's step out
    engine.step()
    assert long_seq.num_computed == 1020  # the budget less the short one's decode row, cut to a block boundary
    while engine.has_unfinished():
        engine.step()
    assert engine.num_free_blocks() == engine.num_blocks
