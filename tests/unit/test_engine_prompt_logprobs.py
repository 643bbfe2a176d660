"""The engine's prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's logprob given
the tokens before it equals a log-softmax over one dense forward of the whole prompt, whether the
prompt runs alone, beside other prompts and decode rows in one step, on the P/D prefill path, or
after its prefix was cached (a request that wants them reuses no cached block); reported once."""

import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, load_model

PROMPT = [256, *b"The quick brown fox jumps over the lazy dog, then naps."]  # 56 tokens: 3 full blocks of 16


@pytest.fixture(scope="module")
def loaded():
    torch.set_num_threads(1)
    return load_model("tiny")


@pytest.fixture()
def engine(loaded):
    return LLMEngine(loaded, EngineConfig(num_blocks=48, block_size=16, max_num_seqs=4))


def _reference(loaded, ids):
    """log_softmax of one dense forward: row i-1 scores token i."""
    return torch.log_softmax(loaded.model.forward_dense(torch.tensor(ids)).float(), dim=-1)


def _check(loaded, ids, got, k):
    ref = _reference(loaded, ids)
    assert len(got) == len(ids) and got[0] is None
    for i, lp in enumerate(got[1:], start=1):
        assert lp.token_id == ids[i]
        assert lp.logprob == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        top_v, top_i = ref[i - 1].topk(k)
        assert [t for t, _ in lp.top] == top_i.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_v.tolist(), abs=1e-4)


def _run(engine, requests):
    """Add ``requests`` ((id, ids, sampling)) and step to the end: id -> (outputs, tokens)."""
    for rid, ids, sp in requests:
        engine.add_request(rid, ids, sp)
    outs: dict = {rid: [] for rid, _, _ in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def test_prompt_logprobs_equal_a_dense_forward_and_come_once(loaded, engine):
    outs = _run(engine, [("a", PROMPT, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=3))])["a"]
    _check(loaded, PROMPT, outs[0].prompt_logprobs, 3)
    assert all(o.prompt_logprobs is None for o in outs[1:]) and len(outs) > 1
    assert engine.num_free_blocks() == engine.num_blocks and engine.num_requests() == 0
    # not asked: nothing
    plain = _run(engine, [("b", PROMPT, SamplingParams(max_tokens=2, temperature=0))])["b"]
    assert all(o.prompt_logprobs is None for o in plain)


def test_long_prompts_go_through_the_head_in_slices(loaded, engine, monkeypatch):
    from pdserve.engine import model_runner, sampling

    monkeypatch.setattr(model_runner, "ROWS_PER_PASS", 7)
    monkeypatch.setattr(sampling, "ROWS_PER_PASS", 5)
    outs = _run(engine, [("s", PROMPT, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)),
                         ("t", PROMPT[:12], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))])
    _check(loaded, PROMPT, outs["s"][0].prompt_logprobs, 2)
    _check(loaded, PROMPT[:12], outs["t"][0].prompt_logprobs, 1)


def test_one_token_prompt_and_zero_alternatives(loaded, engine):
    outs = _run(engine, [("one", [256], SamplingParams(max_tokens=1, prompt_logprobs=0))])["one"]
    assert outs[0].prompt_logprobs == [None]
    outs = _run(engine, [("k0", PROMPT[:9], SamplingParams(max_tokens=1, prompt_logprobs=0))])["k0"]
    assert all(lp.top == () for lp in outs[0].prompt_logprobs[1:])


def test_beside_other_prompts_and_decode_rows_in_one_step(loaded, engine):
    """Several prefill spans and decode rows in one forward: each sequence gets its own rows."""
    alone = _run(engine, [("d", PROMPT[:20], SamplingParams(max_tokens=6, temperature=0))])["d"]
    alone_tokens = [t for o in alone for t in o.new_token_ids]
    engine.add_request("d", PROMPT[:20], SamplingParams(max_tokens=6, temperature=0))
    first = engine.step()  # "d" is a decode row from now on
    other = PROMPT[5:40]
    outs = _run(engine, [("p1", PROMPT, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)),
                         ("x", PROMPT[3:30], SamplingParams(max_tokens=2, temperature=0)),
                         ("p2", other, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))])
    _check(loaded, PROMPT, outs["p1"][0].prompt_logprobs, 2)
    _check(loaded, other, outs["p2"][0].prompt_logprobs, 1)
    assert all(o.prompt_logprobs is None for o in outs["x"])
    # the decode row beside them went on exactly as alone (its outputs came in this loop under "d")
    assert [t for o in first + outs.get("d", []) for t in o.new_token_ids] == alone_tokens


def test_a_cached_prefix_is_not_reused_by_a_request_that_wants_them(loaded, engine):
    _run(engine, [("warm", PROMPT, SamplingParams(max_tokens=1, temperature=0))])
    hits = engine.prefix_hit_tokens()
    again = _run(engine, [("again", PROMPT, SamplingParams(max_tokens=1, temperature=0))])["again"]
    assert engine.prefix_hit_tokens() - hits == 48 and again[0].num_cached_tokens == 48  # the cache holds it
    hits = engine.prefix_hit_tokens()
    outs = _run(engine, [("lp", PROMPT, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))])["lp"]
    assert engine.prefix_hit_tokens() == hits and outs[0].num_cached_tokens == 0
    _check(loaded, PROMPT, outs[0].prompt_logprobs, 2)
    # and the cache still serves the others afterwards
    _run(engine, [("after", PROMPT, SamplingParams(max_tokens=1, temperature=0))])
    assert engine.prefix_hit_tokens() - hits == 48
    assert engine.num_free_blocks() == engine.num_blocks


def test_prefill_only_path_keeps_them_until_release(loaded, engine):
    _run(engine, [("warm", PROMPT, SamplingParams(max_tokens=1, temperature=0))])  # a cached prefix to ignore
    sp = SamplingParams(max_tokens=3, temperature=0, logprobs=1, prompt_logprobs=2)
    firsts = engine.pd.prefill_many([("p", PROMPT, sp),
                                     ("q", PROMPT[:30], SamplingParams(max_tokens=1, temperature=0))])
    _check(loaded, PROMPT, engine.pd.prefill_prompt_logprobs("p"), 2)
    assert engine.pd.prefill_prompt_logprobs("q") is None
    colocated = _run(engine, [("c", PROMPT, sp)])["c"]
    assert firsts["p"] == colocated[0].new_token_ids[0]
    assert [lp.logprob for lp in engine.pd.prefill_prompt_logprobs("p")[1:]] == pytest.approx(
        [lp.logprob for lp in colocated[0].prompt_logprobs[1:]], abs=1e-5)
    engine.pd.release("p")
    engine.pd.release("q")
    assert engine.num_free_blocks() == engine.num_blocks and engine.num_requests() == 0


def test_a_prompt_computed_in_two_spans_continues_its_logprobs(loaded, engine):
    """The runner's side of a chunked prefill (the scheduler admits whole prompts today): a span that
    starts where the prompt's logprobs so far end continues them; one that skips positions is refused."""
    from pdserve.engine.sequence import Sequence

    sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
    seq = Sequence("chunks", list(PROMPT), sp, arrival=0)
    seq.block_table, _ = engine.block_manager.allocate(PROMPT, len(PROMPT), use_prefix_cache=False)
    try:
        cut = 21
        seq.all_ids = PROMPT[:cut]  # the first chunk: positions 0 .. cut-1
        _, _, (first,) = engine.runner.forward_sample([seq], None)
        seq.prompt_logprobs, seq.num_computed, seq.all_ids = first, cut, list(PROMPT)
        assert len(first) == cut + 1  # token 0 (None) .. token cut (from the chunk's last row)
        _, _, (rest,) = engine.runner.forward_sample([seq], None)
        _check(loaded, PROMPT, first + rest, 2)
        seq.prompt_logprobs = first[:-1]  # a gap: position cut-1's logits were never kept
        with pytest.raises(RuntimeError, match="skipped position"):
            engine.runner.forward_sample([seq], None)
    finally:
        engine.block_manager.free(seq.block_table)


def test_a_preempted_request_reports_them_once(loaded):
    """Recomputed after preemption (its prefix may then come from the cache), a request's prompt
    logprobs are not computed or reported again."""
    engine = LLMEngine(loaded, EngineConfig(num_blocks=8, block_size=16, max_num_seqs=2))
    outs = _run(engine, [("a", PROMPT[:40], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)),
                         ("b", PROMPT[1:41], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True,
                                                            prompt_logprobs=1))])
    assert engine.num_preemptions > 0
    reported = [o.prompt_logprobs for o in outs["b"] if o.prompt_logprobs is not None]
    assert len(reported) == 1 and outs["b"][0].prompt_logprobs is reported[0]
    _check(loaded, PROMPT[1:41], reported[0], 1)
    assert sum(len(o.new_token_ids) for o in outs["b"]) == 60
    assert engine.num_free_blocks() == engine.num_blocks


def test_bad_values_are_named():
    for bad in (21, -1, True, 1.5):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
