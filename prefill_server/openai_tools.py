"""Tool calling on /v1/chat/completions (pure): what ``tool_choice`` asks of the output, and the
tool calls found in a choice's text.

- ``tool_choice`` "none" (or no tools): plain text. The tools still reach the chat template.
- a named function (``{"type": "function", "function": {"name": f}}``): the output is held to
  f's ``parameters`` schema (a grammar, as ``response_format: json_schema``) and is returned as
  one call of f, its arguments the generated JSON.
- "required": the output is held to a JSON array of at least one ``{"name": <a tool>,
  "arguments": <its parameters>}`` (exactly one with ``parallel_tool_calls: false``); each
  element is one call.
- "auto": free text; calls are parsed from it in the formats chat templates teach models:
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen 2/2.5/3;
  the text outside them stays the content) or, when the whole output is one such JSON object
  (``"arguments"`` or Llama 3's ``"parameters"``), that object. A block that is not valid JSON
  naming a known tool stays text.

Calls are returned as OpenAI's ``tool_calls`` entries with ids ``call_<hex>``; the choice's
``finish_reason`` is then "tool_calls".
"""

from __future__ import annotations

import json
import re
import uuid

from .openai_params import ResponseFormat

TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _params(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}


def forced_name(choice) -> str | None:
    return choice["function"]["name"] if isinstance(choice, dict) else None


def tool_grammar(tools: list[dict] | None, choice, parallel: bool = True) -> ResponseFormat | None:
    """The response_format a forced tool choice holds the output to (None: free text)."""
    if not tools:
        return None
    name = forced_name(choice)
    if name is not None:
        tool = next(t for t in tools if t["function"]["name"] == name)
        return ResponseFormat("json_schema", json.dumps(_params(tool)), name)
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "arguments": _params(t)},
                  "required": ["name", "arguments"]} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not parallel:
            schema["maxItems"] = 1
        return ResponseFormat("json_schema", json.dumps(schema), "tool_calls")
    return None


def _call(name: str, arguments) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": text}}


def _as_call(doc, names: set[str]) -> dict | None:
    if not isinstance(doc, dict) or doc.get("name") not in names:
        return None
    args = doc.get("arguments", doc.get("parameters", {}))
    return _call(doc["name"], args if isinstance(args, (dict, str)) else {})


def parse_tool_calls(text: str, tools: list[dict] | None, choice) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of one choice's text; content None when the text was only calls."""
    if not tools or choice == "none":
        return text, []
    names = {t["function"]["name"] for t in tools}
    name = forced_name(choice)
    if name is not None:
        return None, [_call(name, text)]
    if choice == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []  # cut short (max_tokens): not a call
        calls = [c for c in (_as_call(i, names) for i in items) if c is not None]
        return (None, calls) if calls else (text, [])
    calls, kept, last = [], [], 0
    for m in TOOL_CALL_BLOCK.finditer(text):
        try:
            call = _as_call(json.loads(m.group(1)), names)
        except ValueError:
            call = None
        if call is not None:
            calls.append(call)
            kept.append(text[last:m.start()])
            last = m.end()
    if calls:
        content = ("".join(kept) + text[last:]).strip()
        return content or None, calls
    try:
        call = _as_call(json.loads(text), names)
    except ValueError:
        call = None
    return (None, [call]) if call is not None else (text, [])
