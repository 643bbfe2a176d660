"""Logprobs in OpenAI's shapes (pure): the engine's ``TokenLogprob``s -> the ``logprobs`` object
of a choice or of one streamed chunk.

- /v1/completions: ``{"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}]
  | null, "text_offset": [int]}`` (``top_logprobs`` null when the request asked for 0 alternatives);
- chat: ``{"content": [{"token": str, "logprob": float, "bytes": [int], "top_logprobs":
  [{"token", "logprob", "bytes"}]}]}``.

With ``echo`` on /v1/completions the prompt's tokens come first (``add_prompt``): the first has
no logprob (``null`` in ``token_logprobs`` and in ``top_logprobs``), each other one its logprob
given the tokens before it, as OpenAI and vLLM report them.

A token's string is the tokenizer's decoding of that token alone (a lone byte of a multi-byte
character is U+FFFD; its ``bytes`` are then the byte itself where the tokenizer is byte-level).
JSON has no -Infinity: a logprob below ``FLOOR`` is reported as ``FLOOR`` (as vLLM does).
"""

from __future__ import annotations

import math

FLOOR = -9999.0


def _num(lp: float) -> float:
    return FLOOR if not math.isfinite(lp) or lp < FLOOR else float(lp)


class LogprobsFormatter:
    """One choice's logprobs: ``add(lps, offsets)`` gives a chunk's object, ``whole()`` the choice's."""

    def __init__(self, kind: str, tokenizer, top: int):
        self.kind, self.tokenizer, self.top = kind, tokenizer, top
        self.items: list[dict] = []  # chat entries
        self.tokens: list[str] = []  # completion columns
        self.token_logprobs: list[float | None] = []  # None: the prompt's first token (echo)
        self.top_logprobs: list[dict | None] = []
        self.text_offset: list[int] = []

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int, text: str) -> list[int]:
        if getattr(self.tokenizer, "BOS", None) == 256 and token_id < 256:  # the built-in byte-level tokenizer
            return [token_id]
        return list(text.encode("utf-8"))

    def size(self) -> int:
        """Tokens so far (``since(size)`` gives what was added after)."""
        return len(self.tokens) if self.kind == "completion" else len(self.items)

    def since(self, start: int) -> dict:
        """The logprobs object of the tokens added after ``start`` tokens."""
        return self._columns(start) if self.kind == "completion" else {"content": self.items[start:]}

    def add_prompt(self, prompt_ids: list[int], lps: list, offsets: list[int]) -> dict:
        """/v1/completions with echo: the prompt's tokens (``lps``: None for the first, then a TokenLogprob
        each, the engine's prompt logprobs), before any generated one."""
        start = len(self.tokens)
        for token_id, lp, offset in zip(prompt_ids, lps, offsets):
            if lp is None:
                self.tokens.append(self._text(token_id))
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
                self.text_offset.append(offset)
            else:
                self.add([lp], [offset])
        return self._columns(start)

    def add(self, lps: list, offsets: list[int]) -> dict:
        """Logprobs of these tokens (``offsets``: where each token's text starts in the choice's text)."""
        if self.kind == "completion":
            start = len(self.tokens)
            for lp, offset in zip(lps, offsets):
                self.tokens.append(self._text(lp.token_id))
                self.token_logprobs.append(_num(lp.logprob))
                alts: dict = {}
                for tid, value in lp.top[: self.top]:
                    alts.setdefault(self._text(tid), _num(value))
                self.top_logprobs.append(alts)
                self.text_offset.append(offset)
            return self._columns(start)
        entries = []
        for lp in lps:
            text = self._text(lp.token_id)
            top = [{"token": (t := self._text(tid)), "logprob": _num(v), "bytes": self._bytes(tid, t)}
                   for tid, v in lp.top[: self.top]]
            entries.append({"token": text, "logprob": _num(lp.logprob), "bytes": self._bytes(lp.token_id, text),
                            "top_logprobs": top})
        self.items += entries
        return {"content": entries}

    def _columns(self, start: int) -> dict:
        return {"tokens": self.tokens[start:], "token_logprobs": self.token_logprobs[start:],
                "top_logprobs": self.top_logprobs[start:] if self.top else None,
                "text_offset": self.text_offset[start:]}

    def whole(self) -> dict:
        return self._columns(0) if self.kind == "completion" else {"content": self.items}
