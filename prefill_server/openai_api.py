"""The OpenAI-compatible request and response shapes (pure functions, no I/O, no engine).

``parse_completion(body)`` / ``parse_chat(body)`` turn a decoded JSON body into a
``ParsedRequest`` or raise ``BadRequest`` naming the field; ``error_body`` builds the
OpenAI error object; the ``*_response`` and ``*_chunk`` helpers build the JSON the
client sees; ``sse`` frames one Server-Sent Event.

Checks that need the tokenizer or the model's context length (prompt too long) are made
by the server after tokenizing; they raise ``BadRequest`` too.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

# Default max_tokens: the legacy completions API says 16; for chat we allow more but cap
# it by the context left after the prompt.
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 256
MAX_STOP_SEQUENCES = 4


class BadRequest(ValueError):
    """The client's request is invalid: HTTP 400 / gRPC INVALID_ARGUMENT."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


@dataclass(slots=True)
class SamplingSpec:
    """Sampling settings as the client gave them (validated); the engine's SamplingParams mirror it."""

    max_tokens: int | None = None  # None = the server's default for this endpoint
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise BadRequest(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.temperature < 0 or self.temperature > 2:
            raise BadRequest(f"temperature must be in [0, 2], got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise BadRequest(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < 0:
            raise BadRequest(f"top_k must be >= 0 (0 disables it), got {self.top_k}", "top_k")
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise BadRequest(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(self.stop)}", "stop")


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
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _number(body: dict, name: str, default, kind=float):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name} must be a number, got {value!r}", name)
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise BadRequest(f"{name} must be an integer, got {value!r}", name)
        return int(value)
    return float(value)


def _int_list(value, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise BadRequest(f"{name} must be a list of non-negative integers", name)
    return list(value)


def _sampling(body: dict, max_tokens_names: tuple[str, ...]) -> SamplingSpec:
    max_tokens = None
    for name in max_tokens_names:
        if body.get(name) is not None:
            max_tokens = _number(body, name, None, int)
            if max_tokens < 1:
                raise BadRequest(f"{name} must be at least 1, got {max_tokens}", name)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a non-empty string or a list of non-empty strings", "stop")
    for unsupported in ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "tools", "response_format"):
        if body.get(unsupported) not in (None, False, 0, 1 if unsupported == "best_of" else None):
            raise BadRequest(f"{unsupported} is not supported by this server", unsupported)
    n = body.get("n", 1)
    if n != 1:
        raise BadRequest(f"only n=1 is supported, got {n!r}", "n")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"seed must be an integer, got {seed!r}", "seed")
    top_k = _number(body, "top_k", 0, int)
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest("ignore_eos must be a boolean", "ignore_eos")
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=0 if top_k == -1 else top_k,
        seed=seed,
        stop=stop,
        stop_token_ids=_int_list(body.get("stop_token_ids") or [], "stop_token_ids"),
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


def parse_completion(body: dict, served_model: str) -> ParsedRequest:
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
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = _int_list(prompt, "prompt")
    else:
        raise BadRequest("prompt must be a non-empty string or a non-empty list of token ids (one prompt per request)", "prompt")
    return ParsedRequest("completion", model, _sampling(body, ("max_tokens",)), prompt=text, prompt_token_ids=ids, stream=stream, include_usage=include_usage)


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


def parse_chat(body: dict, served_model: str) -> ParsedRequest:
    model, stream, include_usage = _common(body, served_model)
    messages = body.get("messages")
    if messages is None:
        raise BadRequest("missing required field 'messages'", "messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    parsed = [_message_text(m, i) for i, m in enumerate(messages)]
    sampling = _sampling(body, ("max_tokens", "max_completion_tokens"))
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
