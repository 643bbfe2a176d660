"""The numbers an OpenAI request (or gRPC Generate) may carry, checked against one table.

``NUMBERS`` (field -> type, range, default; null/absent = the default), ``check_number`` and
``check_token_ids`` (ids in [0, vocab) where the vocabulary is known, else the int32 wire
range): huge integers, 1e308, NaN/Infinity (Python's json accepts them), booleans, strings
and lists are a ``BadRequest`` (errors.py) naming the field and the allowed range, never an error further
in (the Session's int32/int64 fields, the sampler's float32 arithmetic). Re-exported by
``openai_api``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import BadRequest

# Default max_tokens: the legacy completions API says 16; for chat we allow more but cap
# it by the context left after the prompt.
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 256
MAX_STOP_SEQUENCES = 4
MAX_STOP_TOKEN_IDS = 256
# Wire types: max_tokens, top_k and token ids are int32 in protos/generate.proto and
# session.proto (the Session to decode), seed is int64. A larger value made the prefill's
# Sampling message raise ValueError ("Value out of range") -> HTTP 500.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
# The sampler divides float32 logits by the temperature and compares float32 cumulative
# probabilities with top_p: a temperature below ~1e-37 (or a top_p below ~1e-45) becomes
# inf/NaN there and yields token 0 whatever the logits. Below these bounds is refused.
MIN_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-8
MAX_TEMPERATURE = 2.0  # OpenAI's documented range
MAX_N = 16  # choices per prompt
MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit; completions' logprobs uses the same


@dataclass(frozen=True, slots=True)
class NumberField:
    """One numeric request field: its type, allowed range and the value null/absent means."""

    kind: type  # int or float (an int field takes 5.0 as 5; a float field takes ints)
    lo: int | float
    hi: int | float
    default: object
    also: tuple = ()  # allowed values outside [lo, hi] (temperature 0 = greedy)
    bool_ok: bool = False  # false/true taken as 0/1 (chat's boolean logprobs); otherwise a bool is refused
    over_code: str | None = None  # error code for an in-type value above hi
    note: str = ""  # appended to the allowed range in the error message

    def allowed(self, hi=None) -> str:
        hi = self.hi if hi is None else hi
        if self.kind is int:
            text = f"an integer in [{self.lo}, {hi}]"
            if self.lo == hi:
                text = ("null, false or " if self.bool_ok else "null or ") + str(self.lo)
        else:
            text = f"a number in [{self.lo:g}, {hi:g}]"
        if self.also:
            text = " or ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in self.also) + " or " + text
        return text + (f" ({self.note})" if self.note else "")


# Every number the OpenAI endpoints and gRPC Generate accept, in one place. null/absent =
# the default (OpenAI marks them nullable). max_tokens' hi is lowered to the model's
# context length where the caller knows it (parse_* max_model_len=...).
NUMBERS: dict[str, NumberField] = {
    "max_tokens": NumberField(int, 1, INT32_MAX, None, over_code="context_length_exceeded",
                              note="prompt plus max_tokens must fit the model's context length"),
    "max_completion_tokens": NumberField(int, 1, INT32_MAX, None, over_code="context_length_exceeded",
                                         note="prompt plus max_completion_tokens must fit the model's context length"),
    "temperature": NumberField(float, MIN_TEMPERATURE, MAX_TEMPERATURE, 1.0, also=(0,), note="0 is greedy"),
    "top_p": NumberField(float, MIN_TOP_P, 1.0, 1.0),
    "top_k": NumberField(int, -1, INT32_MAX, 0, note="-1 and 0 disable it"),
    "seed": NumberField(int, 0, INT64_MAX, None),
    "n": NumberField(int, 1, MAX_N, 1, note="choices per prompt"),
    "best_of": NumberField(int, 1, MAX_N, None, note="only best_of = n: best-of ranking is not supported"),
    "logprobs": NumberField(int, 0, MAX_TOP_LOGPROBS, None, note="top alternatives per token (/v1/completions)"),
    "top_logprobs": NumberField(int, 0, MAX_TOP_LOGPROBS, None, note="top alternatives per token (chat)"),
    "presence_penalty": NumberField(float, -2.0, 2.0, 0.0, note="accepted for compatibility, not applied"),
    "frequency_penalty": NumberField(float, -2.0, 2.0, 0.0, note="accepted for compatibility, not applied"),
}


def _shown(value) -> str:
    """The value as the client wrote it, short (a 4000-digit integer is not echoed whole)."""
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, float):
        return ("NaN" if math.isnan(value) else "Infinity" if value == math.inf
                else "-Infinity" if value == -math.inf else repr(value))
    if isinstance(value, int):
        if abs(value) < 10**30:
            return str(value)
        return f"{'-' if value < 0 else ''}an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    if isinstance(value, str):
        return f"a string ({value[:20]!r}{'...' if len(value) > 20 else ''})"
    return {type(None): "null", list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def check_number(name: str, value, hi=None):
    """``value`` (as JSON decoded it) validated against NUMBERS[name]; None -> the default.
    Raises BadRequest(param=name) whose message gives the allowed range."""
    f = NUMBERS[name]
    if value is None:
        return f.default
    hi = f.hi if hi is None else min(hi, f.hi)

    def bad(code=None):
        return BadRequest(f"{name} must be {f.allowed(hi)}, got {_shown(value)}", name, code)

    v = value
    if isinstance(v, bool):
        if not f.bool_ok:
            raise bad()
        v = int(v)
    if not isinstance(v, (int, float)):
        raise bad()
    if isinstance(v, float) and not math.isfinite(v):
        raise bad()
    if f.kind is int:
        if isinstance(v, float):
            if not v.is_integer():
                raise bad()
            v = int(v)
    if v in f.also:
        return f.kind(v)
    if v < f.lo:
        raise bad()
    if v > hi:
        raise bad(f.over_code)
    return f.kind(v)


def check_token_ids(value, name: str, vocab_size: int | None = None, max_len: int | None = None) -> list[int]:
    """A list of token ids, each an integer in [0, vocab_size) (without a vocabulary: the int32 wire range)."""
    hi = INT32_MAX if vocab_size is None else vocab_size - 1
    allowed = f"integer token ids in [0, {hi}]" + (" (the vocabulary)" if vocab_size is not None else "")
    if not isinstance(value, (list, tuple)):
        raise BadRequest(f"{name} must be a list of {allowed}, got {_shown(value)}", name)
    if max_len is not None and len(value) > max_len:
        raise BadRequest(f"{name} may hold at most {max_len} token ids, got {len(value)}", name)
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= hi:
            raise BadRequest(f"{name} must be a list of {allowed}, got {_shown(t)} at index {i}", name)
    return list(value)
