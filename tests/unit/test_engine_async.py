"""AsyncLLMEngine: concurrent streams, early exit aborts, P/D calls, step failures, stop()."""

import asyncio

import pytest
import torch

from pdserve.engine import AsyncLLMEngine, EngineConfig, LLMEngine, PromptTooLongError, SamplingParams, load_model
from pdserve.engine.block_manager import blocks_needed
from harness.engine_runs import copy_layer_blocks, run_all

SP = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny")


def _engine(tiny, **kw):
    return LLMEngine(tiny, EngineConfig(**{"num_blocks": 64, "block_size": 8, **kw}))


async def _collect(stream):
    toks, last = [], None
    async for out in stream:
        toks += out.new_token_ids
        last = out
    return toks, last


def test_concurrent_generate_equals_sync(tiny):
    prompts = {f"r{i}": tiny.tokenizer.encode(f"prompt number {i} " * (i + 1)) for i in range(5)}
    expected = run_all(_engine(tiny), {rid: (p, SP) for rid, p in prompts.items()})

    async def main():
        aeng = AsyncLLMEngine(_engine(tiny))
        await aeng.start()
        results = await asyncio.gather(*[_collect(aeng.generate(rid, p, SP)) for rid, p in prompts.items()])
        stats = await aeng.stats()
        await aeng.stop()
        return results, stats

    results, stats = asyncio.run(main())
    assert {rid: toks for rid, (toks, _) in zip(prompts, results)} == expected
    assert all(last.finished and last.finish_reason == "length" for _, last in results)
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_requests"] == 0


def test_leaving_a_stream_early_aborts_and_frees(tiny):
    async def main():
        engine = _engine(tiny)
        aeng = AsyncLLMEngine(engine)
        await aeng.start()
        stream = aeng.generate("r", tiny.tokenizer.encode("hello"),
                               SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        async for out in stream:
            break
        await stream.aclose()
        for _ in range(50):  # the abort travels to the engine thread
            stats = await aeng.stats()
            if stats["num_requests"] == 0:
                break
            await asyncio.sleep(0.01)
        await aeng.stop()
        return out, stats

    out, stats = asyncio.run(main())
    assert out.new_token_ids and not out.finished
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_bad_request_raises_in_caller(tiny):
    async def main():
        aeng = AsyncLLMEngine(_engine(tiny, max_model_len=16))
        await aeng.start()
        try:
            with pytest.raises(PromptTooLongError, match="prompt has 20 tokens"):
                await _collect(aeng.generate("r", [65] * 20, SP))
            with pytest.raises(ValueError, match="temperature must be >= 0"):
                SamplingParams(temperature=-1)
            toks, last = await _collect(aeng.generate("r", [65] * 4,
                                                      SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)))
            assert len(toks) == 3  # the same id is usable again after the failure
            return await aeng.stats()
        finally:
            await aeng.stop()

    stats = asyncio.run(main())
    assert stats["num_requests"] == 0


def test_async_pd_equals_colocated(tiny):
    p = tiny.tokenizer.encode("disaggregated prefill and decode " * 3)
    sp = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)
    expected = run_all(_engine(tiny), {"r": (p, sp)})["r"]

    async def main():
        pre, dec = _engine(tiny), _engine(tiny, num_blocks=100)
        apre, adec = AsyncLLMEngine(pre), AsyncLLMEngine(dec)
        await apre.start()
        await adec.start()
        dst = await adec.reserve("r", len(p), sp.max_tokens)
        layers = []

        def on_layer(layer, src, first):
            layers.append(layer)
            copy_layer_blocks(pre, src, dec, dst[first:first + len(src)], layer)

        first = await apre.prefill_only("r", p, sp, on_layer=on_layer)
        await apre.release("r")
        toks, last = await _collect(adec.add_prefilled("r", p, first, sp))
        s1, s2 = await apre.stats(), await adec.stats()
        await apre.stop()
        await adec.stop()
        return [first] + toks, last, layers, s1, s2

    got, last, layers, s1, s2 = asyncio.run(main())
    assert got == expected and last.finish_reason == "length"
    assert layers == list(range(tiny.config.num_layers))
    for s in (s1, s2):
        assert s["num_free_blocks"] == s["num_blocks"] and s["num_requests"] == 0


def test_step_failure_ends_streams_with_error_and_frees(tiny):
    async def main():
        engine = _engine(tiny)
        real = engine.model.forward
        calls = {"n": 0}

        def flaky(*a, **kw):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("device fell over")
            return real(*a, **kw)

        engine.model.forward = flaky
        aeng = AsyncLLMEngine(engine)
        await aeng.start()
        toks, last = await _collect(aeng.generate("r", [65, 66], SP))
        ok, ok_last = await _collect(aeng.generate("s", [65, 66],
                                                   SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)))
        stats = await aeng.stats()
        await aeng.stop()
        return last, ok_last, stats

    last, ok_last, stats = asyncio.run(main())
    assert last.finished and last.finish_reason == "abort" and "device fell over" in last.error
    assert ok_last.finish_reason == "length"  # the engine keeps serving
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_requests"] == 0


def test_stop_frees_held_requests(tiny):
    async def main():
        engine = _engine(tiny)
        aeng = AsyncLLMEngine(engine)
        await aeng.start()
        await aeng.reserve("held", 10, 10)
        await aeng.prefill_only("pre", [65, 66, 67], SP)
        assert engine.num_free_blocks() < engine.num_blocks
        await aeng.stop()
        return engine

    engine = asyncio.run(main())
    assert engine.num_free_blocks() == engine.num_blocks and engine.num_requests() == 0


def test_stop_ends_open_streams(tiny):
    async def main():
        engine = _engine(tiny)
        aeng = AsyncLLMEngine(engine)
        await aeng.start()
        stream = aeng.generate("long", [65, 66], SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
        first = await stream.__anext__()
        task = asyncio.ensure_future(_collect(stream))
        await aeng.stop()
        toks, last = await asyncio.wait_for(task, timeout=10)
        return first, last, engine

    first, last, engine = asyncio.run(main())
    assert not first.finished
    assert last.finished and last.finish_reason == "abort" and last.error == "engine stopped"
    assert engine.num_free_blocks() == engine.num_blocks and engine.num_requests() == 0


def test_thread_safe_block_reads_follow_awaited_calls(tiny):
    """num_blocks / num_free_blocks() are read without the engine thread and reflect each awaited call."""

    async def main():
        aeng = AsyncLLMEngine(_engine(tiny))
        total = aeng.num_blocks
        assert aeng.num_free_blocks() == total == 64
        await aeng.start()
        blocks = await aeng.reserve("r", 20, 4)
        after_reserve = aeng.num_free_blocks()
        assert aeng.num_requests() == 1
        await aeng.abort("r")
        after_abort = aeng.num_free_blocks()
        assert aeng.num_requests() == 0
        toks, last = await _collect(aeng.generate("g", tiny.tokenizer.encode("hello"), SP))
        after_generate = aeng.num_free_blocks()
        await aeng.stop()
        return total, len(blocks), after_reserve, after_abort, after_generate

    total, reserved, after_reserve, after_abort, after_generate = asyncio.run(main())
    assert reserved == blocks_needed(24, 8)
    assert after_reserve == total - reserved
    assert after_abort == total and after_generate == total


def test_call_blocking_runs_on_the_engine_thread_from_another_thread(tiny):
    """kvpool's lender and pooled requests in a decode reserve and abort from their own threads
    while a request streams; results, errors and the published counts come back as for awaited calls."""
    import threading

    async def main():
        aeng = AsyncLLMEngine(_engine(tiny))
        await aeng.start()
        seen = {}

        def from_a_thread():
            seen["thread"] = aeng.call_blocking(lambda: threading.current_thread().name)
            seen["blocks"] = aeng.call_blocking(aeng.engine.pd.reserve, "loan:x", 20, 4, timeout=10)
            seen["free_after"] = aeng.num_free_blocks()
            try:
                aeng.call_blocking(aeng.engine.pd.reserve, "loan:x", 20, 4, timeout=10)
            except ValueError as exc:
                seen["error"] = str(exc)
            seen["aborted"] = aeng.call_blocking(aeng.engine.abort, "loan:x", timeout=10)

        stream = _collect(aeng.generate("g", tiny.tokenizer.encode("hello"), SP))
        worker = asyncio.get_running_loop().run_in_executor(None, from_a_thread)
        toks, _ = await stream
        await worker
        free = aeng.num_free_blocks()
        await aeng.stop()
        return seen, toks, free

    seen, toks, free = asyncio.run(main())
    assert seen["thread"] == "pdserve-engine"
    assert len(seen["blocks"]) == blocks_needed(24, 8) and seen["free_after"] <= 64 - len(seen["blocks"])
    assert "already in use" in seen["error"] and seen["aborted"] is True
    assert len(toks) == 10 and free == 64
