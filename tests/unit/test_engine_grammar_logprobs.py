"""The engine's constrained decoding (xgrammar over the built-in byte tokenizer) and logprobs:
schema-valid output, a grammar rebuilt from the produced tokens continues exactly where it was
(the P/D resume), bad schemas named, logprobs ordered and equal on the prefill_only path."""

import json

import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, blocks_needed, load_model
from pdserve.engine.grammar import GrammarSpec, Grammars

SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                                      "tag": {"enum": ["x", "yz"]}},
                     "required": ["n", "tag"], "additionalProperties": False})
PROMPT = [256, *b"json please"]


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return LLMEngine(load_model("tiny"), EngineConfig(num_blocks=32, max_num_seqs=4))


def _run(engine, rid, ids, sp):
    engine.add_request(rid, ids, sp)
    tokens, lps, reason = [], [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            lps += out.logprobs or []
            reason = out.finish_reason or reason
    return tokens, lps, reason


def test_schema_output_is_valid_json_and_stops(engine):
    for seed in (1, 2):
        tokens, _, reason = _run(engine, f"s{seed}", PROMPT, SamplingParams(max_tokens=40, temperature=1.0, seed=seed,
                                                                          grammar=GrammarSpec("json_schema", SCHEMA)))
        doc = json.loads(bytes(tokens))
        assert set(doc) == {"n", "tag"} and doc["tag"] in ("x", "yz") and reason == "stop"
    tokens, _, reason = _run(engine, "obj", PROMPT, SamplingParams(max_tokens=8, temperature=0,
                                                                 grammar=GrammarSpec("json_object")))
    assert bytes(tokens).startswith(b"{")


def test_resumed_grammar_continues_where_it_was(engine):
    sp = SamplingParams(max_tokens=30, temperature=0, grammar=GrammarSpec("json_schema", SCHEMA))
    whole, _, _ = _run(engine, "whole", PROMPT, sp)
    for cut in (1, 4, len(whole) - 1):
        rest = SamplingParams(max_tokens=30 - cut, temperature=0, grammar=GrammarSpec("json_schema", SCHEMA, feed=cut))
        tail, _, _ = _run(engine, f"cut{cut}", PROMPT + whole[:cut], rest)
        assert whole[:cut] + tail == whole
    with pytest.raises(ValueError, match="does not follow the grammar"):
        engine.add_request("bad", PROMPT + list(b"[1"), SamplingParams(grammar=GrammarSpec("json_object", feed=2)))
    assert engine.num_requests() == 0


@pytest.mark.parametrize("schema, word", [('{"type": "nope"}', "nope"), ('{"properties": 3}', "properties"),
                                          ("{not json", "schema")])
def test_bad_schemas_are_named(schema, word):
    grammars = Grammars(load_model("tiny").tokenizer, 258)
    with pytest.raises(ValueError, match=word):
        grammars.check(GrammarSpec("json_schema", schema))
    with pytest.raises(ValueError, match="kind"):
        GrammarSpec("yaml")


def test_logprobs_ordered_and_the_same_on_the_prefill_path(engine):
    tokens, lps, _ = _run(engine, "lp", PROMPT, SamplingParams(max_tokens=4, temperature=0, logprobs=3))
    assert [lp.token_id for lp in lps] == tokens
    for lp in lps:
        values = [v for _, v in lp.top]
        assert len(lp.top) == 3 and values == sorted(values, reverse=True)
        assert lp.top[0] == (lp.token_id, pytest.approx(lp.logprob))  # greedy: the most likely one
    assert all(lp.top == () for lp in _run(engine, "lp0", PROMPT, SamplingParams(max_tokens=2, logprobs=0))[1])
    assert _run(engine, "none", PROMPT, SamplingParams(max_tokens=2))[1] == []
    # P/D in one engine: prefill_only reports the first token's logprob; the KV moves (copied here)
    # into a reservation whose add_prefilled outputs the rest, each token with its own logprob
    sp = SamplingParams(max_tokens=4, temperature=0, logprobs=3)
    first = engine.pd.prefill_only("p", PROMPT, sp)
    got = engine.pd.prefill_logprob("p")
    src = engine.pd.prefill_block_ids("p")
    dst = engine.pd.reserve("d", len(PROMPT), 4)
    n = blocks_needed(len(PROMPT), engine.block_size)
    engine.kv_cache.tensor[:, dst[:n]] = engine.kv_cache.tensor[:, src[:n]]
    engine.pd.release("p")
    assert first == tokens[0] and got.logprob == pytest.approx(lps[0].logprob, abs=1e-5)
    assert [t for t, _ in got.top] == [t for t, _ in lps[0].top]
    engine.pd.add_prefilled("d", PROMPT, first, sp)
    rest, rest_lps = [], []
    while engine.has_unfinished():
        for out in engine.step():
            rest += out.new_token_ids
            rest_lps += out.logprobs
    assert rest == tokens[1:] and [lp.token_id for lp in rest_lps] == rest
    assert [lp.logprob for lp in rest_lps] == pytest.approx([lp.logprob for lp in lps[1:]], abs=1e-5)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


def test_a_checkpoint_tokenizer_vocabulary(tmp_path):
    """A byte-level BPE tokenizer.json (as Llama 3 / Qwen ship): the grammar walks its multi-byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from pdserve.engine.tokenizer import HFTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(['{"n": 12, "tag": "yz"}', '{"tag": "x", "n": 7}', "hello world"] * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    hf = HFTokenizer(tmp_path)
    vocab = hf.vocab_size + 7  # a model's embedding is often padded past the tokenizer
    matcher = Grammars(hf, vocab).matcher(GrammarSpec("json_schema", SCHEMA), [0])
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(60):
        logits = torch.randn(vocab, generator=gen)
        matcher.mask(logits)
        token = int(logits.argmax())
        assert matcher.accept(token)
        if matcher.done:
            assert token in hf.eos_token_ids
            break
        out.append(token)
    assert matcher.done and any(len(hf.decode([t])) > 1 for t in out)  # multi-byte tokens were used
    assert set(json.loads(hf.decode(out))) == {"n", "tag"}
