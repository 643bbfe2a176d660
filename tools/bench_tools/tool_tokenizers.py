"""Tokenizer files for the standard tools run against pdserve (compare.py): the built-in model's byte encoding
as inference-perf can sample it, a bench checkpoint with aiperf's corpus words as its vocabulary, and a
tokenizer laid out as a Hugging Face Hub cache entry (aiperf's trace workers read only that)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def ascii_sampling_tokenizer(dest: Path) -> Path:
    """pdserve's byte encoding for inference-perf's random sampler (see the module docstring)."""
    from pdserve.engine.tokenizer import ByteTokenizer
    from tokenizers import Tokenizer

    vocab = {chr(b): b for b in range(128)} | {f"<0x{b:02X}>": b for b in range(128, 256)}
    special = [("<s>", ByteTokenizer.BOS), ("</s>", ByteTokenizer.EOS)] + [(f"<0x{b:02X}>", b) for b in range(128, 256)]
    bos = {"SpecialToken": {"id": "<s>", "type_id": 0}}
    doc = {
        "version": "1.0", "truncation": None, "padding": None, "normalizer": None,
        "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for c, i in special],
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated", "invert": False},
        "post_processor": {"type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}},
                                    {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [ByteTokenizer.BOS], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }
    text = json.dumps(doc)
    ours, theirs = ByteTokenizer(), Tokenizer.from_str(text)
    for sample in ("hello world", " a\n\tb\x00\x7f", "héllo ✓ 日本 \ufffd", "x" * 700):
        assert theirs.encode(sample).ids == ours.encode(sample), sample
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "tokenizer.json").write_text(text)
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "model_max_length": 2048, "clean_up_tokenization_spaces": False}))
    return dest


def bench_checkpoint(source: str) -> Path:
    """``source`` as a model directory, or the bench checkpoint of that size (``peer_model``: written once)."""
    from pdserve.bench.experiments.launcher import MODEL_CACHE
    from pdserve.bench.experiments.peer_model import PEER_MODELS, peer_model

    if source in PEER_MODELS:
        return peer_model(MODEL_CACHE, source, 4096)
    path = Path(source).expanduser().resolve()
    if not (path / "tokenizer.json").is_file():
        sys.exit(f"--word-model {source}: neither a model directory with a tokenizer.json nor one of "
                 f"{', '.join(sorted(PEER_MODELS))}")
    return path


def word_model(source: Path, dest: Path, corpus: Path) -> Path:
    """``source`` (a model directory whose tokenizer is word-level over made-up words, as pdserve's bench
    models are) with the words replaced by the most frequent whitespace-separated words of ``corpus``,
    ids and special tokens kept, the weights linked: the same model, whose vocabulary covers the
    text aiperf draws its synthetic and trace prompts from (its Shakespeare corpus, tokenized with the
    served tokenizer). Over made-up words that corpus is all ``<unk>``, so every prompt would be the same."""
    doc = json.loads((source / "tokenizer.json").read_text())
    model = doc["model"]
    if model.get("type") != "WordLevel":
        sys.exit(f"--word-model: {source}'s tokenizer is {model.get('type')}, not WordLevel")
    special = {t["content"] for t in doc.get("added_tokens", [])}
    slots = sorted(i for w, i in model["vocab"].items() if w not in special)
    counts: dict[str, int] = {}
    for word in corpus.read_text(errors="replace").split():
        if word not in special:
            counts[word] = counts.get(word, 0) + 1
    words = sorted(counts, key=lambda w: (-counts[w], w))[:len(slots)]
    vocab = {w: i for w, i in model["vocab"].items() if w in special}
    vocab |= dict(zip(words, slots))
    vocab |= {f"t{i}": i for i in slots[len(words):]}  # a short corpus: the made-up words fill the rest
    model["vocab"] = vocab
    for t in doc.get("added_tokens", []):  # a corpus word outside the vocabulary decodes as "<unk>" and encodes
        if t["content"] == model.get("unk_token"):  # back to it (a special token would vanish on decode: a
            t["special"] = False  # prompt one token shorter per such word)
    dest.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        target = dest / f.name
        if f.name == "tokenizer.json":
            target.write_text(json.dumps(doc))
        elif not target.exists():
            target.symlink_to(f.resolve())
    return dest


def hub_cache_entry(tokenizer: Path, cache: Path, model: str = "tiny") -> str:
    """``tokenizer``'s files as the Hub cache entry ``pdserve/<model's last part>`` (revision main; made a
    valid repo id) under ``cache``, which it returns: aiperf 0.13.0's trace workers load the tokenizer in
    offline mode through the Hub cache only, so a local folder fails there (HFValidationError: 'Repo id
    must be in the form ...'). Run aiperf with HF_HUB_CACHE=cache and HF_HUB_OFFLINE=1, ``--tokenizer repo``."""
    repo = "pdserve/" + (re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(model).name).strip("-.") or "model")
    commit = "0" * 40
    entry = cache / ("models--" + repo.replace("/", "--"))
    snapshot = entry / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in tokenizer.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")) or f.name == "config.json":
            (snapshot / f.name).write_bytes(f.read_bytes())
    (entry / "refs").mkdir(exist_ok=True)
    (entry / "refs" / "main").write_text(commit)
    return repo
