"""Tokenizers: a byte-level one for the built-in model, and Hugging Face ``tokenizer.json``.

Both expose the same surface::

    encode(text, add_special_tokens=True) -> list[int]
    decode(ids, skip_special_tokens=True) -> str
    eos_token_ids: list[int]
    apply_chat_template(messages, add_generation_prompt=True, tools=None) -> str  # tools: for the template
    detokenizer() -> Detokenizer   # text deltas for streaming (IncrementalDetokenizer, ByteDetokenizer)

Chat templates: the ``chat_template`` of ``tokenizer_config.json`` rendered with jinja2 when
there is one; otherwise ``SIMPLE_CHAT_TEMPLATE`` ("<|role|>\\ncontent\\n" per message; with tools, a
"<|tools|>" line first and an assistant's calls as ``<tool_call>{...}</tool_call>``).
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any, Protocol

SIMPLE_CHAT_TEMPLATE = (
    "{% if tools %}<|tools|>\n{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class Detokenizer(Protocol):
    """Text deltas of a growing list of token ids: ``add(ids)`` the text they complete, ``flush()`` the
    rest held back, ``text`` the total so far."""

    text: str

    def add(self, ids: list[int]) -> str: ...

    def flush(self) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    ``add(ids) -> str`` returns the text the new ids complete; text of a token that ends in the
    middle of a character is held back until the character is complete. ``text`` is the total.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # ids before this are already emitted and fixed
        self._read = 0  # ids before this were decoded in the last emitted text
        self.text = ""

    def add(self, ids: list[int]) -> str:
        self._ids.extend(ids)
        prev = self._tok.decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        new = self._tok.decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        if len(new) <= len(prev):
            return ""
        if new.endswith("\ufffd") and len(self._ids) - self._read < 4:
            return ""  # maybe an incomplete character (at most 4 bytes); an invalid one goes out after 4
        delta = new[len(prev) :]
        # keep a short window so tokenizers that join pieces (leading spaces) decode in context
        self._prefix = self._read
        self._read = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Text of ids still held back (an incomplete character at the end), as replacement chars."""
        prev = self._tok.decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        new = self._tok.decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        delta = new[len(prev) :] if len(new) > len(prev) else ""
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta


class ByteDetokenizer:
    """IncrementalDetokenizer for ByteTokenizer: an incremental UTF-8 decoder, O(1) per token.

    Incomplete characters are held until complete; invalid bytes become U+FFFD at once.
    """

    def __init__(self, skip_special_tokens: bool = True):
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._skip = skip_special_tokens
        self.text = ""

    def add(self, ids: list[int]) -> str:
        data = bytearray()
        for i in ids:
            if i < 256:
                data.append(i)
            elif not self._skip:
                data += b"<s>" if i == ByteTokenizer.BOS else b"</s>" if i == ByteTokenizer.EOS else f"<{i}>".encode()
        delta = self._dec.decode(bytes(data))
        self.text += delta
        return delta

    def flush(self) -> str:
        delta = self._dec.decode(b"", final=True)
        self.text += delta
        return delta


class _ChatTemplateMixin:
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list | None = None) -> str:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)

        def raise_exception(message):
            raise ValueError(f"chat template error: {message}")

        env.globals["raise_exception"] = raise_exception
        template = env.from_string(self.chat_template or SIMPLE_CHAT_TEMPLATE)
        return template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )

    def detokenizer(self, skip_special_tokens: bool = True) -> Detokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)


class ByteTokenizer(_ChatTemplateMixin):
    """One token per UTF-8 byte (ids 0..255), then BOS=256 and EOS=257. The built-in model's."""

    BOS = 256
    EOS = 257
    vocab_size = 258

    def __init__(self):
        self.eos_token_ids = [self.EOS]
        self.bos_token_id = self.BOS
        self.bos_token = ""  # not rendered as text: encode() adds the BOS id
        self.eos_token = ""
        self.chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens else ids

    def detokenizer(self, skip_special_tokens: bool = True) -> ByteDetokenizer:
        return ByteDetokenizer(skip_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            if i < 256:
                out.append(i)
            elif not skip_special_tokens:
                out += b"<s>" if i == self.BOS else b"</s>" if i == self.EOS else f"<{i}>".encode()
        return out.decode("utf-8", errors="replace")

    def hf_files(self, model_max_length: int | None = None) -> dict[str, str]:
        """This tokenizer as Hugging Face files (``tokenizer.json``, ``tokenizer_config.json``), for clients
        that count tokens with ``transformers.AutoTokenizer`` (benchmark tools: docs/benchmarks.md): the same
        ids for every text (byte b is id b, ``<s>`` 256 leads each encoding, ``</s>`` 257), the same text
        for every id list (invalid UTF-8 included). A byte-level BPE without merges over GPT-2's byte-to-character
        map, whose vocabulary lists byte b's character as id b. ``pdserve fetch-model builtin:tiny
        --tokenizer-only`` writes them."""
        byte_char = _gpt2_byte_chars()
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        special = [("<s>", self.BOS), ("</s>", self.EOS)]
        tokenizer: dict[str, Any] = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [{"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True} for text, i in special],
            "normalizer": None,
            "pre_tokenizer": byte_level,
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [self.BOS], "tokens": ["<s>"]}},
            },
            "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": {byte_char[b]: b for b in range(256)}, "merges": []},
        }
        # split_special_tokens: a literal "<s>" in a text is its 3 bytes, as here (transformers reads it;
        # the tokenizers library alone would give id 256)
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                  "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
                  "split_special_tokens": True, "chat_template": SIMPLE_CHAT_TEMPLATE}
        if model_max_length is not None:
            config["model_max_length"] = model_max_length
        return {"tokenizer.json": json.dumps(tokenizer, ensure_ascii=False, indent=1) + "\n",
                "tokenizer_config.json": json.dumps(config, indent=1) + "\n"}


class HFTokenizer(_ChatTemplateMixin):
    """``tokenizer.json`` through the ``tokenizers`` library, plus ``tokenizer_config.json``."""

    def __init__(self, model_dir: str | Path, config_eos_ids: list[int] | None = None):
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        self._tok = Tokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.chat_template = cfg.get("chat_template")
        if isinstance(self.chat_template, list):  # [{"name": "default", "template": ...}, ...]
            by_name = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = by_name.get("default") or next(iter(by_name.values()), None)
        self.bos_token = _token_text(cfg.get("bos_token")) or ""
        self.eos_token = _token_text(cfg.get("eos_token")) or ""
        eos = list(config_eos_ids or [])
        gen_path = model_dir / "generation_config.json"
        if gen_path.exists():
            g = json.loads(gen_path.read_text()).get("eos_token_id")
            eos += [g] if isinstance(g, int) else list(g or [])
        if self.eos_token:
            tid = self._tok.token_to_id(self.eos_token)
            if tid is not None:
                eos.append(tid)
        self.eos_token_ids = sorted(set(eos))
        self.vocab_size = self._tok.get_vocab_size()

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` (its vocabulary, for constrained decoding: engine/grammar.py)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "</s>", ...}
        return value.get("content")
    return value


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's map of the 256 bytes to printable characters (what a ByteLevel pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]
