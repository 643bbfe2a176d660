"""The step trace (engine/step_trace.py): each step's record says what happened in and just before it - a
collection, a request joining, a new batch size, the calls before it, a probe's increase - and the
engine thread fills it when ``EngineConfig.step_trace`` is on."""

import asyncio
import gc
import json

import pytest

from pdserve.engine import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.step_budget import StepShape
from pdserve.engine.step_trace import StepTrace


def _shape(rows, *ids):
    return StepShape(rows=rows, ctx_tokens=10 * rows, ids=frozenset(ids))


def test_a_record_names_the_collection_the_join_the_new_shape_and_the_calls():
    total = [0.0]
    trace = StepTrace(10, probes={"kv_bytes": lambda: total[0]})
    enabled = gc.isenabled()
    gc.disable()  # no automatic collection in between: only the one this test makes
    try:
        trace.begin()
        trace.stepped(_shape(1, "a"))
        trace.calls_done(2, 0.003)  # between the steps: e.g. a reserve and an add_prefilled
        trace.begin()
        gc.collect()
        total[0] += 4096
        trace.stepped(_shape(2, "a", "b"), pending=1, waiting_join=0)
        trace.begin()
        trace.stepped(_shape(2, "a", "b"))
    finally:
        trace.close()
        if enabled:
            gc.enable()
    first, second, third = trace.records()
    assert first["joined"] == 1 and first["new_rows"] and first["gc"] == []
    assert second["joined"] == 1 and second["new_rows"] and second["rows"] == 2 and second["pending"] == 1
    assert second["calls"] == 2 and second["calls_s"] == pytest.approx(0.003)
    assert [g for g, _ in second["gc"]] == [2] and second["gc"][0][1] > 0
    assert second["kv_bytes"] == 4096
    assert third["joined"] == 0 and not third["new_rows"] and third["gc"] == [] and third["kv_bytes"] == 0
    assert third["calls"] == 0
    for rec in trace.records():
        assert rec["seconds"] >= 0 and rec["engine_cpu_s"] >= 0 and rec["wait_s"] >= 0


def test_closed_it_no_longer_times_collections():
    trace = StepTrace(4)
    trace.close()
    trace.begin()
    gc.collect()
    trace.stepped(_shape(1, "a"))
    assert trace.records()[0]["gc"] == []


def test_it_keeps_the_newest_steps_and_writes_them_as_json_lines(tmp_path):
    trace = StepTrace(3)
    for i in range(5):
        trace.begin()
        trace.stepped(_shape(1, f"r{i}"))
    trace.close()
    path = tmp_path / "steps.jsonl"
    assert trace.dump(str(path)) == 3
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 3 and rows[0]["t"] <= rows[-1]["t"]


def test_the_engine_thread_records_every_step_with_the_option(tiny):
    engine = AsyncLLMEngine(LLMEngine(tiny, EngineConfig(num_blocks=64, block_size=4, step_trace=1000)))

    async def run():
        await engine.start()
        try:
            sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
            outs = [o async for o in engine.generate("r", [1, 2, 3, 4, 5], sp)]
        finally:
            await engine.stop()
        return outs

    try:
        outs = asyncio.run(run())
    finally:
        engine.trace.close()
    assert sum(len(o.new_token_ids) for o in outs) == 5
    records = engine.trace.records()
    assert len(records) == 5  # one prompt step and four decode steps
    assert records[0]["chunk_tokens"] == 5 and records[0]["rows"] == 0 and records[0]["calls"] >= 1
    assert [r["rows"] for r in records[1:]] == [1, 1, 1, 1]


def test_off_by_default(tiny):
    assert AsyncLLMEngine(LLMEngine(tiny, EngineConfig(num_blocks=16, block_size=4))).trace is None
