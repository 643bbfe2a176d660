"""choices.py (the choices of one request: ids, seeds, merging, siblings after the first piece,
an error cancels the rest) and openai_logprobs.py (OpenAI's logprobs shapes), in process."""

import asyncio

import pytest

from pdserve.engine.logprobs import TokenLogprob
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.tokenizer import ByteTokenizer
from pdserve.prefill_server.choices import merged, plan
from pdserve.prefill_server.frontend import Piece
from pdserve.prefill_server.openai_logprobs import FLOOR, LogprobsFormatter


def test_plan_numbers_choices_and_seeds():
    sps = [SamplingParams(seed=7), SamplingParams()]
    cs = plan("r", [[1], [2, 3]], sps, 2)
    assert [(c.index, c.prompt_index, c.request_id) for c in cs] == [(0, 0, "r"), (1, 0, "r-c1"), (2, 1, "r-c2"),
                                                                     (3, 1, "r-c3")]
    assert [c.sampling.seed for c in cs] == [7, 8, None, None]


def _fake(log, fail_at=None):
    async def start(c):
        log.append(("start", c.index))
        try:
            for k in range(3):
                await asyncio.sleep(0.001)
                if fail_at == (c.index, k):
                    raise RuntimeError("boom")
                yield Piece([k], "t")
            yield Piece([], "", True, "length")
        finally:
            log.append(("closed", c.index))
    return start


def test_merged_starts_siblings_after_the_first_piece_and_ends_all():
    log = []

    async def main():
        cs = plan("r", [[1], [2]], [SamplingParams(), SamplingParams()], 2)
        return [e async for e in merged(cs, _fake(log))]

    events = asyncio.run(main())
    assert sorted(log[:2]) == [("start", 0), ("start", 2)]  # the leaders first
    assert sum(1 for _, p in events if p.finished) == 4 and len(events) == 16
    assert sorted(i for kind, i in log if kind == "closed") == [0, 1, 2, 3]


def test_an_error_cancels_the_other_choices():
    log = []

    async def main():
        cs = plan("r", [[1]], [SamplingParams()], 3)
        async for _ in merged(cs, _fake(log, fail_at=(1, 1))):
            pass

    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(main())
    assert sorted(i for kind, i in log if kind == "closed") == [0, 1, 2]


def test_logprobs_shapes():
    lps = [TokenLogprob(104, -0.5, ((104, -0.5), (105, -1.0))), TokenLogprob(0xC3, float("-inf"), ((0xC3, -3.0),))]
    comp = LogprobsFormatter("completion", ByteTokenizer(), 2)
    part = comp.add(lps[:1], [0])
    assert part == {"tokens": ["h"], "token_logprobs": [-0.5], "top_logprobs": [{"h": -0.5, "i": -1.0}],
                    "text_offset": [0]}
    comp.add(lps[1:], [1])
    assert comp.whole()["token_logprobs"] == [-0.5, FLOOR] and comp.whole()["text_offset"] == [0, 1]
    assert LogprobsFormatter("completion", ByteTokenizer(), 0).add(lps[:1], [0])["top_logprobs"] is None
    chat = LogprobsFormatter("chat", ByteTokenizer(), 1)
    entry = chat.add(lps[1:], [0])["content"][0]
    assert entry["bytes"] == [0xC3] and entry["logprob"] == FLOOR and entry["top_logprobs"][0]["bytes"] == [0xC3]
    assert chat.whole() == {"content": [entry]}


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now"}}]


def test_tool_calls_parsed_from_text():
    from pdserve.prefill_server.openai_tools import parse_tool_calls

    text = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    content, calls = parse_tool_calls(text, TOOLS, "auto")
    assert content == "Let me check." and calls[0]["function"] == {"name": "get_weather",
                                                                   "arguments": '{"city": "Oslo"}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    content, calls = parse_tool_calls('{"name": "now", "parameters": {}}', TOOLS, "auto")  # Llama 3's shape
    assert content is None and calls[0]["function"]["name"] == "now"
    for plain in ("hello", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
                  "<tool_call>{broken</tool_call>"):
        assert parse_tool_calls(plain, TOOLS, "auto") == (plain, [])
    assert parse_tool_calls(text, TOOLS, "none") == (text, [])
    content, calls = parse_tool_calls('[{"name": "now", "arguments": {}}, {"name": "get_weather", '
                                      '"arguments": {"city": "x"}}]', TOOLS, "required")
    assert content is None and [c["function"]["name"] for c in calls] == ["now", "get_weather"]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    assert parse_tool_calls('{"city": "Rome"}', TOOLS, forced)[1][0]["function"] == {"name": "get_weather",
                                                                                   "arguments": '{"city": "Rome"}'}


def test_tool_request_shapes():
    from pdserve.prefill_server.openai_api import BadRequest, parse_chat

    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = parse_chat({"model": "m", "messages": msgs, "tools": TOOLS,
                    "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "m")
    assert r.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert r.messages[2]["tool_call_id"] == "c1" and r.sampling.response_format.kind == "json_schema"
    assert parse_chat({"model": "m", "messages": msgs[:1], "tools": TOOLS}, "m").sampling.response_format is None
    for extra, param in [({"tools": [{"type": "function"}]}, "tools"), ({"tools": "x"}, "tools"),
                         ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools"),
                         ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                          "tool_choice"),
                         ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
                         ({"tool_choice": "required"}, "tool_choice"),
                         ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
                          "response_format")]:
        with pytest.raises(BadRequest) as info:
            parse_chat({"model": "m", "messages": msgs[:1], **extra}, "m")
        assert info.value.param == param, (extra, info.value.message)
    with pytest.raises(BadRequest, match="tool_call_id"):
        parse_chat({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "m")


def test_a_resumed_request_feeds_its_grammar_the_produced_tokens():
    from pdserve.engine.grammar import GrammarSpec
    from pdserve.prefill_server.mid_stream_resume import resumed

    sp = SamplingParams(max_tokens=10, grammar=GrammarSpec("json_object"), logprobs=2)
    assert resumed(sp, 0) is sp
    once = resumed(sp, 3)
    assert (once.max_tokens, once.grammar.feed, once.logprobs) == (7, 3, 2)
    # a second failure: the prompt now holds all produced tokens (node.generate sends prompt + produced)
    assert resumed(sp, 5).grammar.feed == 5 and resumed(SamplingParams(max_tokens=4), 1).grammar is None


def test_usage_counts_each_prompts_cached_tokens_once_as_its_first_choice_found_them():
    from pdserve.prefill_server import openai_api as oa
    from pdserve.prefill_server.openai_serving import ChoiceState, cached_tokens

    parsed = oa.parse_completion({"model": "m", "prompt": ["a", "b"], "n": 2}, "m")
    cs = plan("r", [[1] * 40, [2] * 20], [SamplingParams(), SamplingParams()], 2)
    states = [ChoiceState(parsed, c.index, ByteTokenizer(), prompt_index=c.prompt_index) for c in cs]
    for s, hit in zip(states, [32, 16, 0, 16]):  # a sibling may find its leader's blocks: not counted again
        s.add(Piece([5], "x", cached_tokens=hit))
        s.add(Piece([6], "y"))  # later pieces say nothing
    assert cached_tokens(states) == 32 + 0
    usage = oa.usage(60, 8, cached_tokens(states))
    assert usage == {"prompt_tokens": 60, "completion_tokens": 8, "total_tokens": 68,
                     "prompt_tokens_details": {"cached_tokens": 32}}
    assert oa.usage(3, 1, 64)["prompt_tokens_details"] == {"cached_tokens": 3}  # never more than the prompt
