"""The OpenAI-compatible request and response shapes (pure functions, no I/O, no engine).

``parse_completion(body)`` / ``parse_chat(body)`` turn a decoded JSON body into a
``ParsedRequest`` or raise ``BadRequest`` naming the field; ``error_body`` builds the
OpenAI error object; ``choice`` / ``response`` / ``chunk`` / ``usage_chunk`` build the JSON
the client sees (one entry per choice, indexed); ``sse`` frames one Server-Sent Event.

Every number a request may carry is checked against one table, ``NUMBERS`` in
``openai_numbers.py`` (re-exported here), so huge integers, NaN/Infinity, booleans and
strings in numeric fields are a BadRequest naming the field and the allowed range. gRPC
Generate uses the same table (``parse_sampling``). The request shapes beyond sampling (a list
of prompts, ``n``, ``echo``, ``logprobs``, ``response_format``, ``tools``) are parsed by
``openai_params.py``.

Checks that need the tokenizer or the model's context length (prompt too long) are made
by the server after tokenizing; they raise ``BadRequest`` too.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from .openai_params import (ResponseFormat, parse_choices, parse_echo, parse_logprobs, parse_message, parse_prompts,
                            parse_response_format, parse_tools)
from .openai_tools import tool_grammar
from .openai_numbers import (DEFAULT_CHAT_MAX_TOKENS, DEFAULT_COMPLETION_MAX_TOKENS, INT32_MAX, INT64_MAX,
                             MAX_STOP_SEQUENCES, MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE, MIN_TEMPERATURE, MIN_TOP_P,
                             NUMBERS, BadRequest, NumberField, check_number, check_token_ids)

__all__ = ["DEFAULT_CHAT_MAX_TOKENS", "DEFAULT_COMPLETION_MAX_TOKENS", "INT32_MAX", "INT64_MAX", "MAX_STOP_SEQUENCES",
           "MAX_STOP_TOKEN_IDS", "MAX_TEMPERATURE", "MIN_TEMPERATURE", "MIN_TOP_P", "NUMBERS", "BadRequest",
           "NumberField", "ParsedRequest", "SamplingSpec", "check_model", "check_number", "check_token_ids", "chunk",
           "error_body", "full_response",
           "parse_chat", "parse_completion", "parse_json", "parse_sampling", "sse", "usage", "usage_chunk"]

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
    logprobs: int | None = None  # top alternatives per token (0: the sampled token's only); None: no logprobs
    response_format: ResponseFormat | None = None  # constrained output (json_object / json_schema)

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
    prompts: list = field(default_factory=list)  # completion: each a string or a list of token ids
    messages: list[dict] | None = None  # chat
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # choices per prompt
    echo: bool = False  # completion: each choice's text starts with its prompt's
    tools: list[dict] | None = None  # chat
    tool_choice: str | dict | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # the engine's and the decode's id
    response_id: str | None = None  # the client's ``id`` when not "cmpl-"/"chatcmpl-" + request_id (a resumed stream's)
    created: int = field(default_factory=lambda: int(time.time()))  # the response's ``created``, one for all its chunks

    @property
    def prompt(self) -> str | None:
        """The first prompt when it is text."""
        return self.prompts[0] if self.prompts and isinstance(self.prompts[0], str) else None

    @property
    def prompt_token_ids(self) -> list[int] | None:
        """The first prompt when it is token ids."""
        return self.prompts[0] if self.prompts and isinstance(self.prompts[0], list) else None


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
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
    if body.get("suffix") not in (None, ""):
        raise BadRequest("suffix is not supported by this server", "suffix")
    for name in ("presence_penalty", "frequency_penalty"):
        check_number(name, body.get(name))  # validated; not applied
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
        stop_token_ids=[] if stop_token_ids is None
        else check_token_ids(stop_token_ids, "stop_token_ids", vocab_size, MAX_STOP_TOKEN_IDS),
        ignore_eos=ignore_eos,
    )


def check_model(model, served_model: str) -> str:
    """``model`` when it is the served one; else BadRequest ``model_not_found`` naming both."""
    if model != served_model:
        raise BadRequest(f"model {model!r} does not exist; this server serves {served_model!r}", "model",
                         "model_not_found")
    return model


def _common(body: dict, served_model: str) -> tuple[str, bool, bool]:
    model = body.get("model")
    if model is None:
        raise BadRequest("missing required field 'model'", "model")
    check_model(model, served_model)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", "stream")
    options = body.get("stream_options")
    if options is None:
        return model, stream, False
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    if not stream:
        raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise BadRequest("stream_options.include_usage must be a boolean", "stream_options")
    return model, stream, include_usage


def _sampling(body: dict, kind: str, names: tuple[str, ...], max_model_len, vocab_size) -> SamplingSpec:
    spec = parse_sampling(body, names, max_model_len, vocab_size)
    spec.logprobs = parse_logprobs(body, kind)
    spec.response_format = parse_response_format(body)
    return spec


def parse_completion(body: dict, served_model: str, max_model_len: int | None = None,
                     vocab_size: int | None = None) -> ParsedRequest:
    model, stream, include_usage = _common(body, served_model)
    prompts = parse_prompts(body, vocab_size)
    n = parse_choices(body, len(prompts))
    echo = parse_echo(body)
    # max_tokens 0 with echo: the prompt (and its logprobs) only, as vLLM answers; without echo it stays a 400
    max_tokens = body.get("max_tokens")
    echo_only = echo and isinstance(max_tokens, (int, float)) and not isinstance(max_tokens, bool) and max_tokens == 0
    sampling = _sampling({**body, "max_tokens": None} if echo_only else body, "completion", ("max_tokens",),
                         max_model_len, vocab_size)
    if echo_only:
        sampling.max_tokens = 0
    if body.get("tools") is not None:
        raise BadRequest("tools are a chat field (/v1/chat/completions)", "tools")
    return ParsedRequest("completion", model, sampling, prompts=prompts, stream=stream, include_usage=include_usage,
                         n=n, echo=echo)


def parse_chat(body: dict, served_model: str, max_model_len: int | None = None,
               vocab_size: int | None = None) -> ParsedRequest:
    model, stream, include_usage = _common(body, served_model)
    messages = body.get("messages")
    if messages is None:
        raise BadRequest("missing required field 'messages'", "messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    parsed = [parse_message(m, i) for i, m in enumerate(messages)]
    sampling = _sampling(body, "chat", ("max_tokens", "max_completion_tokens"), max_model_len, vocab_size)
    if body.get("echo") not in (None, False):
        raise BadRequest("echo is a /v1/completions field", "echo")
    tools, tool_choice, parallel = parse_tools(body)
    forced = tool_grammar(tools, tool_choice, parallel)
    if forced is not None:
        if sampling.response_format is not None:
            raise BadRequest("response_format cannot be combined with a tool_choice that forces a call",
                             "response_format")
        sampling.response_format = forced
    return ParsedRequest("chat", model, sampling, messages=parsed, stream=stream, include_usage=include_usage,
                         n=parse_choices(body), tools=tools, tool_choice=tool_choice)


# -- responses ----------------------------------------------------------------------------
def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: the prompt tokens served from a prefix cache (not computed)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": max(0, min(cached_tokens, prompt_tokens))}}


def _head(req: ParsedRequest, obj: str) -> dict:
    prefix = "cmpl-" if req.kind == "completion" else "chatcmpl-"
    return {"id": req.response_id or prefix + req.request_id, "object": obj, "created": req.created, "model": req.model}


def choice(req: ParsedRequest, index: int, text: str | None, finish_reason: str, logprobs: dict | None = None) -> dict:
    """One choice of a whole (non-streamed) response (``text`` None: a chat message of tool calls only)."""
    if req.kind == "completion":
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish_reason}


def response(req: ParsedRequest, choices: list[dict], prompt_tokens: int, completion_tokens: int,
             cached_tokens: int = 0) -> dict:
    out = _head(req, "text_completion" if req.kind == "completion" else "chat.completion")
    out["choices"] = choices
    out["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
    return out


def full_response(req: ParsedRequest, text: str, finish_reason: str, prompt_tokens: int,
                  completion_tokens: int) -> dict:
    return response(req, [choice(req, 0, text, finish_reason)], prompt_tokens, completion_tokens)


def chunk(req: ParsedRequest, text: str | None, finish_reason: str | None = None, first: bool = False, index: int = 0,
          logprobs: dict | None = None) -> dict:
    """One streamed chunk of choice ``index``; ``first`` adds the assistant role (chat)."""
    if req.kind == "completion":
        out = _head(req, "text_completion")
        out["choices"] = [{"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}]
    else:
        out = _head(req, "chat.completion.chunk")
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        out["choices"] = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    return out


def usage_chunk(req: ParsedRequest, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    out = _head(req, "text_completion" if req.kind == "completion" else "chat.completion.chunk")
    out["choices"] = []
    out["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
    return out
