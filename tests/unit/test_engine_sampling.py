"""Sampler filters, stop conditions, tokenizers, incremental detokenizer, chat templates, KV layout."""

import json

import pytest
import torch

from pdserve.engine import EngineConfig, KVCache, LLMEngine, SamplingParams, load_model
from pdserve.engine.sampling import Sampler
from pdserve.engine.tokenizer import ByteTokenizer, HFTokenizer


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny")


def _collect(engine):
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_top_k_and_top_p_restrict_the_choice():
    sampler = Sampler(seed=0)
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, -1.0]]).repeat(200, 1)
    k2 = sampler.sample(logits, [SamplingParams(temperature=1.0, top_k=2)] * 200, [0] * 200)
    assert set(k2) == {0, 1}
    # probabilities ~ .66 .24 .09 ...: top_p 0.8 keeps the first two
    p8 = sampler.sample(logits, [SamplingParams(temperature=1.0, top_p=0.8)] * 200, [0] * 200)
    assert set(p8) == {0, 1}
    everything = sampler.sample(logits, [SamplingParams(temperature=5.0)] * 200, [0] * 200)
    assert len(set(everything)) >= 4
    assert sampler.sample(logits[:2], [SamplingParams(temperature=0)] * 2, [0, 0]) == [0, 0]


def test_seed_is_per_position():
    sampler = Sampler()
    logits = torch.zeros(1, 1000)
    sp = SamplingParams(temperature=1.0, seed=5)
    a = [sampler.sample(logits, [sp], [pos])[0] for pos in range(6)]
    b = [sampler.sample(logits, [sp], [pos])[0] for pos in range(6)]
    assert a == b and len(set(a)) > 1


def test_a_resumed_seeded_request_draws_what_the_whole_one_did(tiny):
    """A request resumed after k tokens (prompt + those tokens as its prompt, ``seed_position=k``) samples the
    rest of the uninterrupted request's tokens: the seeded draw of a token depends on its position in the output."""
    engine = LLMEngine(tiny, EngineConfig(num_blocks=32, block_size=16))
    prompt = tiny.tokenizer.encode("abc")
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    engine.add_request("whole", prompt, sp)
    whole = [t for o in _collect(engine) for t in o.new_token_ids]
    k = 5
    engine.add_request("resumed", prompt + whole[:k], SamplingParams(max_tokens=12 - k, temperature=1.0, seed=3,
                                                                     ignore_eos=True, seed_position=k))
    assert [t for o in _collect(engine) for t in o.new_token_ids] == whole[k:]
    engine.add_request("restarted", prompt + whole[:k], SamplingParams(max_tokens=12 - k, temperature=1.0, seed=3,
                                                                       ignore_eos=True))
    assert [t for o in _collect(engine) for t in o.new_token_ids] != whole[k:]  # position 0 again: other draws
    with pytest.raises(ValueError, match="seed_position"):
        SamplingParams(seed_position=-1)


def test_max_tokens_and_eos(tiny):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=32, block_size=16))
    prompt = tiny.tokenizer.encode("abc")
    engine.add_request("len", prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    outs = _collect(engine)
    assert sum(len(o.new_token_ids) for o in outs) == 5 and outs[-1].finish_reason == "length"
    # make the first greedy token a stop token: the request ends with no output token
    first = outs[0].new_token_ids[0]
    engine.add_request("stop", prompt, SamplingParams(max_tokens=5, temperature=0, stop_token_ids=[first]))
    outs = _collect(engine)
    assert outs[-1].finish_reason == "stop" and all(not o.new_token_ids for o in outs)
    assert engine.num_free_blocks() == engine.num_blocks


def test_eos_stops_unless_ignored(tiny):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=32, block_size=16))
    prompt = tiny.tokenizer.encode("abc")
    engine.add_request("x", prompt, SamplingParams(max_tokens=3, temperature=0))
    first = _collect(engine)[0].new_token_ids[0]
    engine.eos_ids = {first}  # pretend the model's EOS is what greedy picks first
    engine.add_request("eos", prompt, SamplingParams(max_tokens=3, temperature=0))
    assert _collect(engine)[-1].finish_reason == "stop"
    engine.add_request("ign", prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    outs = _collect(engine)
    assert outs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs) == 3


def test_stop_string_cuts_text(tiny):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=32, block_size=16))
    prompt = tiny.tokenizer.encode("abc")
    engine.add_request("free", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    outs = _collect(engine)
    full_text = "".join(o.text for o in outs)
    ids = [t for o in outs for t in o.new_token_ids]
    assert full_text == tiny.tokenizer.decode(ids)
    # the tiny model's greedy text is random bytes: pick a stop string from its printable middle
    printable = [i for i, ch in enumerate(full_text) if ch.isprintable() and ch != "\ufffd"]
    assert len(printable) >= 2, f"the tiny model is built to write printable text, got {full_text!r}"
    cut = printable[len(printable) // 2]
    stop = full_text[cut]
    expected = full_text[: full_text.find(stop)]
    engine.add_request("cut", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]))
    outs = _collect(engine)
    assert outs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outs) == expected
    assert engine.num_free_blocks() == engine.num_blocks


def test_incremental_detokenizer_never_splits_utf8():
    tok = ByteTokenizer()
    text = "héllo → 世界 🎉"
    det = tok.detokenizer()
    deltas = [det.add([b]) for b in text.encode("utf-8")]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[1] == "" and deltas[2] == "é"  # 'é' is two bytes: nothing after the first


def test_byte_tokenizer_and_builtin_chat_template():
    tok = ByteTokenizer()
    assert tok.encode("hi") == [256, 104, 105] and tok.decode(tok.encode("hi")) == "hi"
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|user|>\nhi\n<|assistant|>\n"
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template([{"content": "no role"}])


def test_hf_tokenizer_json_and_template(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "[UNK]": 4}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.add_special_tokens(["<s>", "</s>"])
    t.save(str(tmp_path / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "bos_token": "<s>", "eos_token": {"content": "</s>"}})
    )
    tok = HFTokenizer(tmp_path, config_eos_ids=[])
    assert tok.encode("hello world") == [2, 3]
    assert tok.eos_token_ids == [1]
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}]) == "<s>[user] hello"


def test_kv_layout_contract():
    kv = KVCache(num_layers=3, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8)
    assert kv.block_nbytes == 2 * 4 * 2 * 8 * 4
    base = kv.tensor.data_ptr()
    for layer in range(3):
        for block in range(5):
            assert kv.layer(layer)[block].data_ptr() - base == kv.block_offset(layer, block)
            assert kv.layer(layer)[block].data_ptr() - base == (layer * 5 + block) * kv.block_nbytes
    assert kv.layer(1).data_ptr() == kv.tensor[1].data_ptr()  # a view, not a copy
    rows = torch.tensor([2 * 8 + 3])  # block 2, offset 3
    k, v = torch.ones(1, 2, 8), 2 * torch.ones(1, 2, 8)
    kv.write(1, rows, k, v)
    assert torch.equal(kv.tensor[1, 2, 0, 3], k[0]) and torch.equal(kv.tensor[1, 2, 1, 3], v[0])
    assert kv.tensor.count_nonzero() == 2 * 2 * 8


def test_windowed_detokenizer_matches_full_decode():
    """The generic (Hugging Face) detokenizer, driven with a byte tokenizer's decode."""
    from pdserve.engine.tokenizer import IncrementalDetokenizer

    tok = ByteTokenizer()
    text = "naïve café → 世界 🎉 done"
    det = IncrementalDetokenizer(tok)
    deltas = [det.add([b]) for b in text.encode("utf-8")]
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)
    bad = IncrementalDetokenizer(tok)
    out = "".join(bad.add([b]) for b in [0xFF, 0xFE, 0xFD, 0xFC, 0x41]) + bad.flush()
    assert out.endswith("A") and "\ufffd" in out  # invalid bytes are not held forever
