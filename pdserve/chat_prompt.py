"""The chat-to-prompt rule: an OpenAI chat request's ``messages`` and ``tools`` -> the prompt's text.

One home for what both the prefill and the router compute from a chat body: the prefill renders it
to tokenize the request (``prefill_server/openai_params.parse_message`` validates each message
first, then ``frontend.py`` renders), the router to hash the prompt's blocks the way the prefill will
(``router/prompt.py``; it never validates: a malformed body is the prefill's to refuse). A rule that
differed between them would cost the router's cache-aware choice its hits, never correctness.

- ``template_message(message)``: one message as chat templates read it: ``role`` (``developer`` is
  ``system``), ``content`` (text parts joined; "" for an assistant's tool calls without content), an
  assistant's ``tool_calls`` (``{"id", "type": "function", "function": {"name", "arguments"}}``, the
  arguments as an object where their JSON parses) and a tool message's ``tool_call_id``. For a
  well-formed message; a malformed one may raise (TypeError, KeyError, AttributeError).
- ``chat_prompt(tokenizer, messages, tools)``: the chat template with the generation prompt, over
  messages already in the template's form; ``tools`` given to the template only when there are some.

Pure: no I/O; the tokenizer is any of the engine's (``apply_chat_template``).
"""

from __future__ import annotations

import json
from typing import Any, Protocol


class ChatTemplate(Protocol):
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list | None = None) -> str: ...


def template_message(message: dict) -> dict:
    role, content, calls = message.get("role"), message.get("content"), message.get("tool_calls")
    if isinstance(content, list):  # content parts: the text ones
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    if content is None and role == "assistant" and calls:
        content = ""
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    if calls is not None:
        out["tool_calls"] = [_call_for_template(c) for c in calls]
    if role == "tool":
        out["tool_call_id"] = message.get("tool_call_id")
    return out


def _call_for_template(call: dict) -> dict:
    fn = call["function"]
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        pass
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def chat_prompt(tokenizer: ChatTemplate, messages: list[dict], tools: list[dict] | None = None) -> str:
    if tools:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
