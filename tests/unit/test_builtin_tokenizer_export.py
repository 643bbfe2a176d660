"""The built-in model's byte-level tokenizer as Hugging Face files (``ByteTokenizer.hf_files``, written by
``pdserve fetch-model builtin:tiny --tokenizer-only``): benchmark clients (aiperf, inference-perf: see
docs/benchmarks.md) count prompt and output tokens with ``transformers.AutoTokenizer`` on these files, so
they must give pdserve's ids for every text and pdserve's text for every id list."""

from __future__ import annotations

import argparse
import random

import pytest

from pdserve import model_fetch
from pdserve.engine.tokenizer import ByteTokenizer, HFTokenizer

TEXTS = ["hello world", "", " a\n\tb\x00\x7f  ", "héllo ✓ 日本 🙂", "\ufffd", "x" * 3000]
LITERAL_SPECIALS = "a <s> b </s>"  # bytes to pdserve; transformers reads the files with split_special_tokens


def _random_bytes(n: int) -> list[bytes]:
    rng = random.Random(0)
    return [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))) for _ in range(n)]


def written(tmp_path):
    args = argparse.Namespace(source="builtin:tiny", dest=tmp_path / "tok", tokenizer_only=True)
    assert model_fetch.run(args) == 0
    return tmp_path / "tok"


def test_the_tokenizers_library_encodes_and_decodes_as_the_byte_tokenizer():
    from tokenizers import Tokenizer

    ours, theirs = ByteTokenizer(), Tokenizer.from_str(ByteTokenizer().hf_files()["tokenizer.json"])
    assert theirs.get_vocab_size(with_added_tokens=True) == ByteTokenizer.vocab_size
    for text in TEXTS:
        assert theirs.encode(text).ids == ours.encode(text)
        assert theirs.encode(text, add_special_tokens=False).ids == ours.encode(text, add_special_tokens=False)
        assert theirs.decode(ours.encode(text)) == text
    for data in _random_bytes(200):  # invalid UTF-8 too: the same replacement characters
        assert theirs.decode(list(data)) == ours.decode(list(data))


def test_fetch_model_writes_them_and_pdserve_and_transformers_load_them(tmp_path):
    folder = written(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    hf = HFTokenizer(folder)
    assert hf.eos_token_ids == [ByteTokenizer.EOS]
    for text in TEXTS:
        assert hf.encode(text) == ByteTokenizer().encode(text)
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(folder))
    assert (auto.bos_token_id, auto.eos_token_id) == (ByteTokenizer.BOS, ByteTokenizer.EOS)
    assert auto.model_max_length == 2048  # the built-in model's context
    for text in [*TEXTS, LITERAL_SPECIALS]:
        assert auto(text).input_ids == ByteTokenizer().encode(text)
        assert auto.decode(auto(text).input_ids, skip_special_tokens=True) == text
    messages = [{"role": "user", "content": "Hi"}]
    assert auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        ByteTokenizer().apply_chat_template(messages)


def test_a_second_run_leaves_the_files_alone(tmp_path):
    folder = written(tmp_path)
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    written(tmp_path)
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before


@pytest.mark.parametrize("source, tokenizer_only, message", [
    ("tiny", False, "--tokenizer-only writes its tokenizer"),
    ("builtin:large", True, "'builtin:large' is not a built-in model"),
])
def test_what_a_built_in_name_cannot_give_is_a_usage_error(tmp_path, capsys, source, tokenizer_only, message):
    args = argparse.Namespace(source=source, dest=tmp_path / "tok", tokenizer_only=tokenizer_only)
    assert model_fetch.run(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "tok" / "tokenizer.json").exists()
