"""The chat-to-prompt rule has one home (pdserve/chat_prompt.py): the router hashes the very prompt
the prefill computes, for a conversation with tools, tool calls and tool answers too."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pdserve.chat_prompt import chat_prompt, template_message
from pdserve.engine.tokenizer import ByteTokenizer
from pdserve.prefill_server.frontend import Frontend
from pdserve.prefill_server.openai_api import parse_chat
from pdserve.router.prompt import prompt_token_ids

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CONVERSATION = {
    "model": "tiny",
    "tools": TOOLS,
    "messages": [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Oslo?"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "-3 C, snow"},
    ],
}
# A template that reads what real ones do: the tools, an assistant's calls (arguments as an object),
# a tool message's call id.
TOOL_TEMPLATE = (
    "{% if tools %}[tools]{% for t in tools %}{{ t['function']['name'] }};{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<call {{ c['id'] }} {{ c['function']['name'] }}"
    " city={{ c['function']['arguments']['city'] }}>{% endfor %}"
    "{% if m.get('tool_call_id') %}<for {{ m['tool_call_id'] }}>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def _tokenizers():
    plain = ByteTokenizer()  # SIMPLE_CHAT_TEMPLATE: a <|tools|> line, <tool_call> for calls
    templated = ByteTokenizer()
    templated.chat_template = TOOL_TEMPLATE
    return [plain, templated]


def _prefill_ids(body: dict, tok) -> list[int]:
    """The ids the prefill computes for ``body``: parse_chat (validation) then the Frontend's rule."""
    parsed = parse_chat(body, "tiny", 4096, tok.vocab_size)
    return Frontend.prompt_ids_list(SimpleNamespace(tokenizer=tok), parsed)[0]  # it reads only the tokenizer


@pytest.mark.parametrize("tok", _tokenizers(), ids=["builtin-template", "tool-template"])
def test_router_and_prefill_compute_the_same_prompt_for_a_conversation_with_tools(tok):
    router_ids = prompt_token_ids(json.dumps(CONVERSATION).encode(), "chat", tok)
    assert router_ids is not None
    assert router_ids == _prefill_ids(CONVERSATION, tok)
    text = tok.decode(router_ids)
    assert "get_weather" in text.split("\n")[0 if tok.chat_template else 1]  # the tools are rendered first
    without_tools = {k: v for k, v in CONVERSATION.items() if k != "tools"}
    assert prompt_token_ids(json.dumps(without_tools).encode(), "chat", tok) != router_ids  # tools count


def test_the_templated_prompt_reads_roles_calls_and_call_ids():
    tok = _tokenizers()[1]
    text = chat_prompt(tok, [template_message(m) for m in CONVERSATION["messages"]], TOOLS)
    assert text == ("[tools]get_weather;\n[system]Answer briefly.\n[user]Weather in Oslo?\n"
                    "[assistant]<call c1 get_weather city=Oslo>\n[tool]-3 C, snow<for c1>\n[assistant]")


def test_no_tools_renders_as_none_given():
    tok = _tokenizers()[1]
    messages = [template_message({"role": "user", "content": "hi"})]
    assert chat_prompt(tok, messages, []) == chat_prompt(tok, messages, None) == "[user]hi\n[assistant]"
