"""The TBT-bounded batch (engine/step_budget.py): the step-time model's fit and predictions, and the decode
engine's join gate holding prefilled requests (their KV held) while the predicted step is over the bound.

The gate's model is injected (a fake ``predict``): what is asserted is the batch the prediction allows, not
how fast any step is."""

import math

import pytest

from pdserve.engine import EngineConfig, LLMEngine, OutOfBlocksError, SamplingParams
from pdserve.engine.errors import TbtBoundError
from pdserve.engine.step_budget import StepShape, StepTimeModel, TbtBudget, shape_of

BS = 4
PROMPT = list(range(10, 30))  # 20 tokens: 5 blocks


class PerRow:
    """A fake step-time model: ``per_row_s`` seconds per decode row, whatever the context."""

    def __init__(self, per_row_s: float):
        self.per_row_s, self.asked = per_row_s, []

    def predict(self, rows: int, ctx_tokens: int) -> float:
        self.asked.append((rows, ctx_tokens))
        return rows * self.per_row_s


def test_the_fit_recovers_a_linear_step_time():
    model = StepTimeModel(decay=1.0)
    for rows in (1, 2, 3, 4) * 5:
        for ctx in (500 * rows, 700 * rows):
            model.observe(rows, ctx, 0.010 + 0.002 * rows + 0.001 * ctx / 1000)
    a, b, c = model.fit()
    assert (a, b, c) == pytest.approx((0.010, 0.002, 0.001), abs=1e-6)
    assert model.predict(6, 3000) == pytest.approx(0.010 + 0.012 + 0.003, abs=1e-6)


def test_before_the_fit_only_one_row_more_than_seen_is_tried_and_only_if_fewer_rows_were_within_the_bound():
    model = StepTimeModel()
    assert model.predict(2, 100) == math.inf  # nothing seen: one row only (admits() never asks for one)
    model.observe(1, 100, 0.02)
    assert model.fit() is None  # one row count: no fit
    assert model.predict(1, 100) == 0.02
    assert model.predict(2, 200) == 0.02  # one row more: at least what one took (tried if that is within a bound)
    assert model.predict(3, 300) == math.inf  # not before two rows were seen
    assert TbtBudget(0.03, model).admits(1, 100, 100) and not TbtBudget(0.01, model).admits(1, 100, 100)


def test_a_prediction_never_undercuts_a_smaller_batch_seen():
    model = StepTimeModel(decay=1.0, min_steps=2)
    model.observe(1, 100, 0.05)  # a slow one-row step (say a collection in it)
    for _ in range(10):
        model.observe(2, 200, 0.01)
        model.observe(3, 300, 0.012)
    assert model.predict(3, 300) >= 0.05 * 0.99


def test_the_gate_admits_a_lone_request_whatever_the_prediction():
    gate = TbtBudget(0.001, PerRow(1.0))
    assert gate.admits(0, 0, 100)
    assert not gate.admits(1, 100, 100) and gate.held == 1


def test_a_bound_that_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        TbtBudget(0.0, PerRow(1.0))
    with pytest.raises(ValueError, match="tbt_slo_ms"):
        EngineConfig(tbt_slo_ms=-1)


def _decode(tiny, **config):
    return LLMEngine(tiny, EngineConfig(num_blocks=64, block_size=BS, **config))


def _prefilled(engine, rid, max_tokens, reserve=True):
    """Reserve and join as a P/D decode does once the KV is in (the KV's content does not matter here)."""
    if reserve:
        engine.pd.reserve(rid, len(PROMPT), max_tokens)
    engine.pd.add_prefilled(rid, PROMPT, 7, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def _run(engine):
    """Step to the end: (request id -> tokens, the running batch's size at each step)."""
    tokens, sizes = {}, []
    while engine.has_unfinished():
        outs = engine.step()
        sizes.append(len(engine.running) + sum(1 for o in outs if o.finished))
        for o in outs:
            tokens[o.request_id] = tokens.get(o.request_id, 0) + len(o.new_token_ids)
    return tokens, sizes


def test_a_reservation_over_the_bound_is_refused_for_now(tiny):
    engine = _decode(tiny, tbt_slo_ms=25.0)
    engine.scheduler.join_gate = TbtBudget(0.025, PerRow(0.010))  # two rows fit 25 ms, three do not
    free = engine.num_free_blocks()
    engine.pd.reserve("a", len(PROMPT), 4)
    _prefilled(engine, "b", 4)  # one reserved (KV on its way), one running: both count
    with pytest.raises(TbtBoundError, match="TBT bound of 25 ms") as refused:
        engine.pd.reserve("c", len(PROMPT), 4)
    assert isinstance(refused.value, OutOfBlocksError) and refused.value.code == "tbt_bound"  # busy now
    assert "c" not in engine.request_ids()
    engine.abort("a")
    engine.pd.reserve("c", len(PROMPT), 4)  # room again
    engine.abort("b"), engine.abort("c")
    assert engine.num_free_blocks() == free and engine.num_requests() == 0 and not engine.pd.reserved_at


def test_a_running_request_that_ends_before_a_new_one_could_join_leaves_it_room(tiny):
    engine = _decode(tiny, tbt_slo_ms=25.0)
    engine.scheduler.join_gate = TbtBudget(0.025, PerRow(0.010))  # two rows fit, three do not
    _prefilled(engine, "long", 50)
    _prefilled(engine, "short", 3)  # joins with 2 tokens left
    engine.step()
    engine.pd.join_lead_s = 0.0  # no lead time learned yet: every running request counts
    with pytest.raises(TbtBoundError):
        engine.pd.reserve("c", len(PROMPT), 4)
    engine.pd.join_lead_s = 0.05  # reservations took 50 ms to join lately: "short" (1 token, ~20 ms) is gone by then
    engine.pd.reserve("c", len(PROMPT), 4)
    engine.pd.join_lead_s = 0.005  # 5 ms: it is still running then
    with pytest.raises(TbtBoundError):
        engine.pd.reserve("d", len(PROMPT), 4)
    for rid in ("long", "short", "c"):
        engine.abort(rid)
    assert engine.num_requests() == 0 and not engine.pd.reserved_at


def test_the_lead_time_is_measured_from_reserve_to_add_prefilled(tiny):
    engine = _decode(tiny, tbt_slo_ms=10_000.0)
    engine.pd.reserve("a", len(PROMPT), 4)
    assert "a" in engine.pd.reserved_at and engine.pd.join_lead_s == 0.0
    _prefilled(engine, "a", 4, reserve=False)
    assert engine.pd.join_lead_s > 0 and not engine.pd.reserved_at


def test_the_batch_is_capped_by_the_prediction_and_the_rest_join_as_others_finish(tiny):
    engine = _decode(tiny)
    free = engine.num_free_blocks()
    for rid, n in (("a", 3), ("b", 6), ("c", 6)):  # reserved before the bound (the prediction changed since)
        engine.pd.reserve(rid, len(PROMPT), n)
    model = PerRow(0.010)  # 10 ms a row: two rows fit 25 ms, three do not
    engine.scheduler.join_gate = TbtBudget(0.025, model)
    _prefilled(engine, "a", 3, reserve=False)
    _prefilled(engine, "b", 6, reserve=False)
    _prefilled(engine, "c", 6, reserve=False)
    held = free - engine.num_free_blocks()
    engine.step()
    assert [s.request_id for s in engine.running] == ["a", "b"]
    assert [s.request_id for s in engine.scheduler.joining] == ["c"]
    assert free - engine.num_free_blocks() >= held  # c waits with its blocks (its KV) held
    assert (3, 3 * (len(PROMPT) + 1)) in model.asked  # asked with c's context added
    tokens, sizes = _run(engine)
    assert max(sizes) == 2  # never three
    assert tokens == {"a": 1, "b": 4, "c": 5}  # c joined once a finished, and ran to its end (the first step's
    # tokens, a's and b's, were not collected)
    assert engine.num_free_blocks() == free and engine.num_requests() == 0


def test_without_a_bound_every_prefilled_request_joins_at_once(tiny):
    engine = _decode(tiny)
    assert engine.scheduler.join_gate is None
    for rid in ("a", "b", "c"):
        _prefilled(engine, rid, 4)
    engine.step()
    assert len(engine.running) == 3 and not engine.scheduler.joining


def test_a_waiting_request_aborted_frees_its_blocks(tiny):
    engine = _decode(tiny)
    free = engine.num_free_blocks()
    engine.pd.reserve("a", len(PROMPT), 8)
    engine.pd.reserve("b", len(PROMPT), 8)
    engine.scheduler.join_gate = TbtBudget(0.001, PerRow(1.0))  # one at a time
    _prefilled(engine, "a", 8, reserve=False)
    _prefilled(engine, "b", 8, reserve=False)
    engine.step()
    assert [s.request_id for s in engine.scheduler.joining] == ["b"]
    assert engine.abort("b")
    assert not engine.scheduler.joining and "b" not in engine.request_ids()
    _run(engine)
    assert engine.num_free_blocks() == free and engine.num_requests() == 0


def test_the_engine_fits_its_own_decode_steps(tiny):
    engine = _decode(tiny, tbt_slo_ms=10_000.0)  # a bound nothing reaches, once the model has seen a step
    assert isinstance(engine.scheduler.join_gate.model, StepTimeModel)
    _prefilled(engine, "a", 5)
    engine.step()  # one row seen: one more may be tried
    _prefilled(engine, "b", 5)
    engine.step()
    _prefilled(engine, "c", 5)
    tokens, sizes = _run(engine)
    model = engine.step_model
    assert model.steps == len(sizes) + 2 and set(model.by_rows) == {1, 2, 3}
    assert tokens == {"a": 2, "b": 3, "c": 4}  # (the tokens of the two steps above were not collected)


def test_a_batch_shape_counts_rows_chunks_and_context(tiny):
    engine = _decode(tiny)
    _prefilled(engine, "a", 4)
    engine.pd.reserve("p", len(PROMPT), 4)
    engine.pd.prefill_reserved("p", PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    batch = engine.scheduler.schedule()
    shape = shape_of(batch)
    assert shape == StepShape(rows=1, chunk_tokens=len(PROMPT), ctx_tokens=2 * len(PROMPT) + 1,
                              ids=frozenset({"a", "p"}))
