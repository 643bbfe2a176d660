"""OpenAI request fields beyond sampling (pure: validation only, no tokenizer, no engine).

- ``parse_prompts``: /v1/completions' ``prompt`` -- a string, a list of strings, a list of
  token ids, or a list of token-id lists -> a list of prompts (each a string or an id list);
- ``parse_choices``: ``n`` (choices per prompt, each an independent sample of the same prompt)
  and the cap on prompts x n;
- ``parse_echo``: completions' ``echo`` (the prompt's text before each choice's text);
- ``parse_logprobs``: completions' ``logprobs: k`` / chat's ``logprobs: true, top_logprobs: k``
  -> k (top alternatives per token; 0 = only the sampled token's) or None;
- ``parse_response_format``: ``{"type": "text" | "json_object" | "json_schema", ...}`` ->
  ``ResponseFormat`` or None (the schema's grammar is compiled by the frontend, which turns a
  schema the grammar library refuses into a BadRequest naming ``response_format``);
- ``parse_tools``: ``tools`` / ``tool_choice`` shapes.

Every malformed value is a ``BadRequest`` whose ``param`` names the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pdserve.chat_prompt import template_message

from .openai_numbers import BadRequest, check_number, check_token_ids

MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_CHOICES = 64  # prompts x n: sequences one request may run



@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """A constrained-output request: ``kind`` "json_object" (any JSON object) or "json_schema"
    (``schema``: the schema as JSON text)."""

    kind: str
    schema: str | None = None
    name: str | None = None


def parse_prompts(body: dict, vocab_size: int | None = None) -> list[str | list[int]]:
    if "prompt" not in body:
        raise BadRequest("missing required field 'prompt'", "prompt")
    prompt = body["prompt"]
    what = "prompt must be a non-empty string, a list of strings, a list of token ids or a list of token-id lists"
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            prompts = list(prompt)
        elif all(isinstance(p, list) for p in prompt):
            prompts = [check_token_ids(p, "prompt", vocab_size) for p in prompt]
        elif not any(isinstance(p, (str, list)) for p in prompt):
            prompts = [check_token_ids(prompt, "prompt", vocab_size)]
        else:
            raise BadRequest(what + " (not a mix)", "prompt")
    else:
        raise BadRequest(what, "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise BadRequest(f"prompt may hold at most {MAX_PROMPTS} prompts, got {len(prompts)}", "prompt")
    for i, p in enumerate(prompts):
        if not p:
            where = "" if len(prompts) == 1 else f" (prompt {i})"
            raise BadRequest(f"prompt must not be empty{where}", "prompt")
    return prompts


def parse_choices(body: dict, n_prompts: int = 1) -> int:
    n = check_number("n", body.get("n"))
    if n * n_prompts > MAX_CHOICES:
        raise BadRequest(f"n ({n}) x prompts ({n_prompts}) must be at most {MAX_CHOICES}", "n")
    best_of = body.get("best_of")
    if best_of is not None and check_number("best_of", best_of, hi=n) != n:
        raise BadRequest(f"best_of must be null or equal to n ({n}): best-of ranking is not supported", "best_of")
    return n


def parse_echo(body: dict) -> bool:
    echo = body.get("echo")
    if echo is None:
        return False
    if not isinstance(echo, bool):
        raise BadRequest("echo must be a boolean", "echo")
    return echo


def parse_logprobs(body: dict, kind: str) -> int | None:
    """Top alternatives per token (0: the sampled token's logprob only), or None for no logprobs."""
    if kind == "completion":
        if check_number("top_logprobs", body.get("top_logprobs")) is not None:
            raise BadRequest("top_logprobs is a chat field; /v1/completions takes logprobs: <int>", "top_logprobs")
        return check_number("logprobs", body.get("logprobs"))
    want = body.get("logprobs")
    if want is not None and not isinstance(want, bool):
        raise BadRequest("logprobs must be a boolean on /v1/chat/completions (top_logprobs: "
                         "<int> asks for alternatives)", "logprobs")
    top = check_number("top_logprobs", body.get("top_logprobs"))
    if top and not want:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if want else None


def parse_response_format(body: dict) -> ResponseFormat | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise BadRequest("response_format must be an object like {\"type\": \"json_object\"}", "response_format")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind != "json_schema":
        raise BadRequest(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                         "response_format")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise BadRequest("response_format.json_schema must be an object {\"name\": ..., \"schema\": {...}}",
                         "response_format")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise BadRequest("response_format.json_schema.name must be a string", "response_format")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise BadRequest("response_format.json_schema.schema must be a JSON Schema object", "response_format")
    return ResponseFormat("json_schema", json.dumps(schema), name)


def parse_tools(body: dict) -> tuple[list[dict] | None, str | dict | None, bool]:
    """``tools`` (each ``{"type": "function", "function": {"name", "parameters"?}}``), ``tool_choice``
    and ``parallel_tool_calls`` (may one answer hold several calls; default true)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise BadRequest("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none"):
            raise BadRequest("tool_choice needs tools", "tool_choice")
        return None, None, parallel
    if not isinstance(tools, list) or not tools:
        raise BadRequest("tools must be a non-empty list", "tools")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise BadRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"tools[{i}].function.name must be a non-empty string", "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON Schema object", "tools")
        names.append(fn["name"])
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or fn.get("name") not in names:
            raise BadRequest(f"tool_choice must name one of the tools: {names}", "tool_choice")
    elif choice not in ("none", "auto", "required"):
        raise BadRequest("tool_choice must be none, auto, required or {\"type\": \"function\", ...}", "tool_choice")
    return tools, choice, parallel


def parse_message(message, index: int) -> dict:
    """One chat message, checked, as the chat template reads it (``pdserve.chat_prompt.template_message``:
    the rule the router hashes prompts by too)."""
    if not isinstance(message, dict):
        raise BadRequest(f"messages[{index}] must be an object", "messages")
    role = message.get("role")
    if role not in ("system", "user", "assistant", "developer", "tool"):
        raise BadRequest(f"messages[{index}].role must be one of system, user, assistant, tool, got {role!r}",
                         "messages")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text ones
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"messages[{index}].content parts must be {{'type': 'text', 'text': ...}}", "messages")
    calls = message.get("tool_calls")
    if not isinstance(content, (str, list)) and not (content is None and role == "assistant" and calls):
        raise BadRequest(f"messages[{index}].content must be a string", "messages")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str)
                for c in calls):
            raise BadRequest(f"messages[{index}].tool_calls must be a list of {{\"function\": "
                             f"{{\"name\", \"arguments\"}}}} "
                             "on an assistant message", "messages")
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise BadRequest(f"messages[{index}].tool_call_id must be a string (the call this answers)", "messages")
    return template_message(message)
