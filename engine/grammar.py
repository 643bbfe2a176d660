"""Constrained decoding: a request's output held to a grammar (JSON, a JSON Schema) through
xgrammar (the ``grammar`` extra: ``pip install pdserve[grammar]``, imported on first use).

- ``GrammarSpec(kind, schema, feed)``: what SamplingParams carries. ``kind`` "json_object"
  (any JSON object) or "json_schema" (``schema``: JSON text). ``feed``: how many trailing
  prompt tokens were generated under this grammar already (a resumed P/D request: prefill
  sends prompt + the tokens produced so far; the matcher is rebuilt by accepting them).
- ``Grammars(tokenizer, vocab_size)``: one per engine; the tokenizer's vocabulary as xgrammar
  sees it (the built-in byte tokenizer: one raw byte per id, BOS a special token, EOS the stop
  token; a ``tokenizer.json``: its vocabulary and encoding, as xgrammar reads a Hugging Face
  fast tokenizer), compiled grammars cached. ``eos_ids``: the tokens that end the output
  (default: the tokenizer's).
  ``check(spec)`` raises ValueError naming what is wrong (a schema xgrammar refuses);
  ``matcher(spec, prompt_ids)`` the state one sequence carries.
- ``Matcher``: ``mask(logits_row)`` sets every token the grammar forbids next to -inf;
  ``accept(token)``; ``done``: the grammar reached its end (only a stop token may follow).

JSON is generated compact (no free whitespace between tokens): a small model cannot spend its
max_tokens on spaces.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

KINDS = ("json_object", "json_schema")


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: str
    schema: str | None = None
    feed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "json_schema" and not isinstance(self.schema, str):
            raise ValueError("a json_schema grammar needs its schema as JSON text")
        if isinstance(self.feed, bool) or not isinstance(self.feed, int) or self.feed < 0:
            raise ValueError(f"grammar feed must be a non-negative integer, got {self.feed!r}")


def _xgr():
    try:
        import xgrammar
    except ImportError:  # pragma: no cover - depends on the installation
        raise ValueError("constrained output (response_format) needs xgrammar: pip "
                         "install 'pdserve[grammar]'") from None
    return xgrammar


def _tokenizer_info(xgr, tokenizer, vocab_size: int, eos_ids):
    eos = sorted(eos_ids if eos_ids is not None else getattr(tokenizer, "eos_token_ids", None) or []) or None
    backend = getattr(tokenizer, "backend", None)  # HFTokenizer: the tokenizers.Tokenizer
    if backend is None:  # the built-in byte tokenizer: ids 0..255 are bytes, the rest special ("")
        vocab = [bytes([i]) if i < 256 else "" for i in range(vocab_size)]
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=eos)
    # what TokenizerInfo.from_huggingface does for a fast tokenizer, without transformers: the
    # vocabulary by id, its encoding (byte-level, byte-fallback or raw) read from tokenizer.json
    vocab = [""] * vocab_size
    for token, idx in backend.get_vocab(with_added_tokens=True).items():
        if idx < vocab_size:
            vocab[idx] = token
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())  # xgrammar is pinned (pyproject)
    return xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=vocab_size, stop_token_ids=eos,
                             add_prefix_space=meta["add_prefix_space"])


class Grammars:
    def __init__(self, tokenizer, vocab_size: int, eos_ids=None):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, eos_ids
        self._compiler = None
        self._compiled: dict[tuple[str, str | None], object] = {}

    def _compile(self, spec: GrammarSpec):
        key = (spec.kind, spec.schema)
        if key not in self._compiled:
            xgr = _xgr()
            compiler = self._compiler
            if compiler is None:
                info = _tokenizer_info(xgr, self.tokenizer, self.vocab_size, self.eos_ids)
                compiler = self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            # (a json_schema spec has its schema: GrammarSpec checks)
            schema = spec.schema if spec.kind == "json_schema" and spec.schema is not None else '{"type": "object"}'
            try:
                json.loads(schema)
                compiled = compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=False)
            except (RuntimeError, ValueError, TypeError) as exc:
                message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
                raise ValueError(f"the JSON schema cannot be used: {message[:300]}") from None
            if len(self._compiled) > 256:
                self._compiled.clear()
            self._compiled[key] = compiled
        return self._compiled[key]

    def check(self, spec: GrammarSpec) -> None:
        """Compile ``spec`` (cached); ValueError naming the problem when it cannot be used."""
        self._compile(spec)

    def matcher(self, spec: GrammarSpec, prompt_ids: list[int]) -> Matcher:
        """A fresh matcher that has accepted the last ``spec.feed`` prompt tokens."""
        if spec.feed > len(prompt_ids):
            raise ValueError(f"grammar feed {spec.feed} exceeds the prompt's {len(prompt_ids)} tokens")
        m = Matcher(_xgr(), self._compile(spec), self.vocab_size)
        for token in prompt_ids[len(prompt_ids) - spec.feed:]:
            if not m.accept(token):
                raise ValueError(f"token {token} of the resumed output does not follow the grammar")
        return m


class Matcher:
    def __init__(self, xgr, compiled, vocab_size: int):
        self._xgr = xgr
        self._m = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> None:
        """Forbidden next tokens of this row (``[vocab]``, in place) -> -inf."""
        self._m.fill_next_token_bitmask(self._bitmask, 0)
        row = logits.view(1, -1)
        self._xgr.apply_token_bitmask_inplace(row, self._bitmask.to(row.device))

    def accept(self, token: int) -> bool:
        return self._m.accept_token(token)

    @property
    def done(self) -> bool:
        return self._m.is_terminated()
