"""The engine's busy time (engine/busy_clock.py, ``busy_seconds()`` of the servers' engines): seconds its one
thread spent in steps. Requests in flight together share those steps, so the counter grows by at most the wall
time however many there are (their own intervals, summed, do not): checked on the built-in engine and on
``--engine sim`` (whose step sleeps count), and read back through /metrics as the planner reads it."""

import asyncio
import time

import pytest
import torch

from pdserve.engine import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams, load_model
from pdserve.engine.busy_clock import BusyClock
from pdserve.engine.sim.engine import SimEngine
from pdserve.engine.sim.profile import FORMAT, parse_profile
from pdserve.engine.tokenizer import ByteTokenizer
from pdserve.metrics import ServerMetrics
from pdserve.planner.exposition import parse, total
from pdserve.planner.observe import ENGINE_BUSY

SP = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SIM_PROFILE = {"format": FORMAT, "name": "busy-test",
               "model": {"num_layers": 4, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32", "vocab_size": 258,
                         "context_length": 2048, "eos_token_ids": [257]},
               "step": {"base_s": 0.003, "prefill_token_s": 2e-5, "prefill_pair_s": 0.0, "decode_seq_s": 1e-4,
                        "decode_context_token_s": 0.0}}


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_clock_counts_steps_and_a_step_in_progress_up_to_now():
    clock = FakeClock()
    busy = BusyClock(clock)
    assert busy.seconds() == 0.0 and busy.end() == 0.0     # no step begun: nothing counted
    busy.begin()
    clock.now += 2.0
    assert busy.seconds() == pytest.approx(2.0)             # in progress: up to now
    busy.begin()                                            # a second begin keeps the first
    clock.now += 1.0
    assert busy.end() == pytest.approx(3.0) and busy.seconds() == pytest.approx(3.0)
    clock.now += 50.0                                       # idle: not counted
    busy.begin()
    clock.now += 0.5
    reads = [busy.seconds()]
    busy.end()
    reads.append(busy.seconds())
    assert reads == pytest.approx([3.5, 3.5]) and reads[1] >= reads[0]


async def _timed(stream) -> tuple[int, float]:
    """(tokens, seconds from the call to its last output) of one request."""
    start, tokens = time.perf_counter(), 0
    async for out in stream:
        tokens += len(out.new_token_ids)
    return tokens, time.perf_counter() - start


def _two_at_once(engine) -> dict:
    """Two requests in flight together on one engine thread: the engine's busy seconds over the run, the wall
    time, each request's own interval, and what /metrics says of the busy time afterwards."""
    metrics = ServerMetrics("prefill")

    async def main():
        aeng = AsyncLLMEngine(engine)
        metrics.follow_counter("engine_busy", aeng.busy_seconds)
        await aeng.start()
        busy0, wall0 = aeng.busy_seconds(), time.perf_counter()
        runs = await asyncio.gather(*[_timed(aeng.generate(f"r{i}", [65 + i] * 200, SP)) for i in range(2)])
        wall, busy = time.perf_counter() - wall0, aeng.busy_seconds() - busy0
        await aeng.stop()
        return {"busy": busy, "wall": wall, "runs": runs, "total": aeng.busy_seconds()}

    out = asyncio.run(main())
    out["scraped"] = total(parse(metrics.render()[0].decode()), ENGINE_BUSY)
    return out


def _check(out: dict) -> None:
    assert [tokens for tokens, _ in out["runs"]] == [SP.max_tokens] * 2
    intervals = sum(seconds for _, seconds in out["runs"])
    assert 0 < out["busy"] <= out["wall"], out
    assert intervals > 1.5 * out["busy"], out  # the requests overlapped: their intervals count the steps twice
    assert out["scraped"] == pytest.approx(out["total"])  # /metrics carries the counter the planner reads


def test_two_concurrent_requests_on_the_built_in_engine_count_their_shared_steps_once():
    torch.set_num_threads(1)
    engine = LLMEngine(load_model("tiny"), EngineConfig(num_blocks=128, block_size=8))
    _check(_two_at_once(engine))


def test_two_concurrent_requests_on_the_sim_count_its_step_sleeps_once():
    engine = SimEngine(parse_profile(SIM_PROFILE), ByteTokenizer(), EngineConfig(block_size=16))
    out = _two_at_once(engine)
    _check(out)
    assert out["busy"] >= engine.runner.modelled_s  # every step's modelled sleep is busy time
