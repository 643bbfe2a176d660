"""The OpenAI-compatible request and response shapes (pure functions, no I/O, no engine).

``parse_completion(body)`` / ``parse_chat(body)`` turn a decoded JSON body into a
``ParsedRequest`` or raise ``BadRequest`` naming the field; ``error_body`` builds the
OpenAI error object; the ``*_response`` and ``*_chunk`` helpers build the JSON the
client sees; ``sse`` frames one Server-Sent Event.

Every number a request may carry is checked against one table, ``NUMBERS`` (field ->
type, range, default; null/absent = the default), token-id lists by ``check_token_ids``
(ids in [0, vocab) where the vocabulary is known, else the int32 wire range): huge
integers, 1e308, NaN/Infinity (Python's json accepts them), booleans, strings and lists are
a BadRequest naming the field and the allowed range, never an error further in (the
Session's int32/int64 fields, the sampler's float32 arithmetic). gRPC Generate uses the
same table (``parse_sampling``).

Checks that need the tokenizer or the model's context length (prompt too long) are made
by the server after tokenizing; they raise ``BadRequest`` too.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

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


class BadRequest(ValueError):
    """The client's request is invalid: HTTP 400 / gRPC INVALID_ARGUMENT."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


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
    "n": NumberField(int, 1, 1, 1, note="only one choice per request is supported"),
    "best_of": NumberField(int, 1, 1, 1, note="best_of is not supported"),
    "logprobs": NumberField(int, 0, 0, None, bool_ok=True, note="logprobs is not supported by this server"),
    "top_logprobs": NumberField(int, 0, 0, None, note="top_logprobs is not supported by this server"),
    "presence_penalty": NumberField(float, -2.0, 2.0, 0.0, note="accepted for compatibility, not applied"),
    "frequency_penalty": NumberField(float, -2.0, 2.0, 0.0, note="accepted for compatibility, not applied"),
}


def _shown(value) -> str:
    """The value as the client wrote it, short (a 4000-digit integer is not echoed whole)."""
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, float):
        return "NaN" if math.isnan(value) else "Infinity" if value == math.inf else "-Infinity" if value == -math.inf else repr(value)
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


@dataclass(slots=True)
class SamplingSpec:
    """Sampling settings as the client gave them (validated against NUMBERS); the engine's SamplingParams mirror it."""

    max_tokens: int | None = None  # None = the server's default for this endpoint
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.max_tokens = check_number("max_tokens", self.max_tokens)
        self.temperature = check_number("temperature", self.temperature)
        self.top_p = check_number("top_p", self.top_p)
        self.top_k = check_number("top_k", self.top_k)
        self.seed = check_number("seed", self.seed)
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise BadRequest(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(self.stop)}", "stop")
        self.stop_token_ids = check_token_ids(self.stop_token_ids, "stop_token_ids", max_len=MAX_STOP_TOKEN_IDS)


@dataclass(slots=True)
class ParsedRequest:
    kind: str  # "completion" or "chat"
    model: str
    sampling: SamplingSpec
    prompt: str | None = None  # completion with a text prompt
    prompt_token_ids: list[int] | None = None  # completion with token ids
    messages: list[dict] | None = None  # chat
    stream: bool = False
    include_usage: bool = False
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except ValueError as exc:  # an integer literal over Python's 4300-digit limit
        raise BadRequest(f"request body has a number json cannot hold: {str(exc)[:120]}", code="invalid_json") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def parse_sampling(body: dict, max_tokens_names: tuple[str, ...] = ("max_tokens",), max_model_len: int | None = None,
                   vocab_size: int | None = None) -> SamplingSpec:
    """The sampling fields of a request body (also gRPC Generate's, as a dict) -> SamplingSpec."""
    max_tokens = None
    for name in max_tokens_names:
        if body.get(name) is not None:
            max_tokens = check_number(name, body[name], hi=max_model_len)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a non-empty string or a list of non-empty strings", "stop")
    for unsupported in ("echo", "suffix", "tools", "response_format"):
        if body.get(unsupported) not in (None, False):
            raise BadRequest(f"{unsupported} is not supported by this server", unsupported)
    for name in ("n", "best_of", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty"):
        check_number(name, body.get(name))  # validated; only the defaults are served (penalties: ignored)
    top_k = check_number("top_k", body.get("top_k"))
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest("ignore_eos must be a boolean", "ignore_eos")
    stop_token_ids = body.get("stop_token_ids")
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=check_number("temperature", body.get("temperature")),
        top_p=check_number("top_p", body.get("top_p")),
        top_k=0 if top_k == -1 else top_k,
        seed=check_number("seed", body.get("seed")),
        stop=stop,
        stop_token_ids=[] if stop_token_ids is None else check_token_ids(stop_token_ids, "stop_token_ids", vocab_size, MAX_STOP_TOKEN_IDS),
        ignore_eos=ignore_eos,
    )


def _common(body: dict, served_model: str) -> tuple[str, bool, bool]:
    model = body.get("model")
    if model is None:
        raise BadRequest("missing required field 'model'", "model")
    if model != served_model:
        raise BadRequest(f"model {model!r} does not exist; this server serves {served_model!r}", "model", "model_not_found")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    return model, stream, bool(options.get("include_usage", False))


def parse_completion(body: dict, served_model: str, max_model_len: int | None = None, vocab_size: int | None = None) -> ParsedRequest:
    model, stream, include_usage = _common(body, served_model)
    if "prompt" not in body:
        raise BadRequest("missing required field 'prompt'", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    text, ids = None, None
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt must not be empty", "prompt")
        text = prompt
    elif isinstance(prompt, list) and prompt and not any(isinstance(t, (str, list)) for t in prompt):
        ids = check_token_ids(prompt, "prompt", vocab_size)
    else:
        raise BadRequest("prompt must be a non-empty string or a non-empty list of token ids (one prompt per request)", "prompt")
    return ParsedRequest("completion", model, parse_sampling(body, ("max_tokens",), max_model_len, vocab_size), prompt=text, prompt_token_ids=ids, stream=stream, include_usage=include_usage)


def _message_text(message, index: int) -> dict:
    if not isinstance(message, dict):
        raise BadRequest(f"messages[{index}] must be an object", "messages")
    role = message.get("role")
    if role not in ("system", "user", "assistant", "developer", "tool"):
        raise BadRequest(f"messages[{index}].role must be one of system, user, assistant, got {role!r}", "messages")
    content = message.get("content")
    if isinstance(content, list):  # content parts: keep the text ones
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"messages[{index}].content parts must be {{'type': 'text', 'text': ...}}", "messages")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise BadRequest(f"messages[{index}].content must be a string", "messages")
    return {"role": "system" if role == "developer" else role, "content": content}


def parse_chat(body: dict, served_model: str, max_model_len: int | None = None, vocab_size: int | None = None) -> ParsedRequest:
    model, stream, include_usage = _common(body, served_model)
    messages = body.get("messages")
    if messages is None:
        raise BadRequest("missing required field 'messages'", "messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    parsed = [_message_text(m, i) for i, m in enumerate(messages)]
    sampling = parse_sampling(body, ("max_tokens", "max_completion_tokens"), max_model_len, vocab_size)
    return ParsedRequest("chat", model, sampling, messages=parsed, stream=stream, include_usage=include_usage)


# -- responses ----------------------------------------------------------------------------
def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def _head(req: ParsedRequest, obj: str) -> dict:
    prefix = "cmpl-" if req.kind == "completion" else "chatcmpl-"
    return {"id": prefix + req.request_id, "object": obj, "created": int(time.time()), "model": req.model}


def full_response(req: ParsedRequest, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
    if req.kind == "completion":
        out = _head(req, "text_completion")
        out["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
    else:
        out = _head(req, "chat.completion")
        out["choices"] = [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish_reason}]
    out["usage"] = usage(prompt_tokens, completion_tokens)
    return out


def chunk(req: ParsedRequest, text: str | None, finish_reason: str | None = None, first: bool = False) -> dict:
    """One streamed chunk; ``first`` adds the assistant role (chat)."""
    if req.kind == "completion":
        out = _head(req, "text_completion")
        out["choices"] = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]
    else:
        out = _head(req, "chat.completion.chunk")
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        out["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    return out


def usage_chunk(req: ParsedRequest, prompt_tokens: int, completion_tokens: int) -> dict:
    out = _head(req, "text_completion" if req.kind == "completion" else "chat.completion.chunk")
    out["choices"] = []
    out["usage"] = usage(prompt_tokens, completion_tokens)
    return out
