"""OpenAI request parsing: every bad input is a BadRequest naming the field."""

import json

import pytest

from pdserve.prefill_server.openai_api import (BadRequest, chunk, error_body, full_response, parse_chat,
                                               parse_completion, parse_json, sse)

M = "tiny"


def test_valid_completion_and_chat():
    r = parse_completion({"model": M, "prompt": "hi", "max_tokens": 5, "temperature": 0, "stop": "x",
                          "stream": True}, M)
    assert ((r.prompt, r.sampling.max_tokens, r.sampling.temperature, r.sampling.stop, r.stream)
            == ("hi", 5, 0.0, ["x"], True))
    r = parse_completion({"model": M, "prompt": [[1, 2, 3]]}, M)
    assert r.prompt_token_ids == [1, 2, 3] and r.sampling.max_tokens is None
    c = parse_chat({"model": M, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                    "max_completion_tokens": 3}, M)
    assert c.messages == [{"role": "user", "content": "a"}] and c.sampling.max_tokens == 3


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x"}, "model"),
        ({"model": "gpt-4", "prompt": "x"}, "model"),
        ({"model": M}, "prompt"),
        ({"model": M, "prompt": ""}, "prompt"),
        ({"model": M, "prompt": {"a": 1}}, "prompt"),
        ({"model": M, "prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"model": M, "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": M, "prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"model": M, "prompt": "x", "temperature": -0.1}, "temperature"),
        ({"model": M, "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": M, "prompt": "x", "top_p": 1.5}, "top_p"),
        ({"model": M, "prompt": "x", "n": 17}, "n"),
        ({"model": M, "prompt": ["a", [1]]}, "prompt"),
        ({"model": M, "prompt": ["a", ""]}, "prompt"),
        ({"model": M, "prompt": ["a"] * 33, "n": 2}, "n"),
        ({"model": M, "prompt": "x", "echo": 1}, "echo"),
        ({"model": M, "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"model": M, "prompt": "x", "response_format": {"type": "xml"}}, "response_format"),
        ({"model": M, "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
         "response_format"),
        ({"model": M, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": M, "prompt": "x", "stream": "yes"}, "stream"),
        ({"model": M, "prompt": "x", "logprobs": 21}, "logprobs"),
        ({"model": M, "prompt": "x", "logprobs": True}, "logprobs"),
    ],
)
def test_bad_completion_fields(body, param):
    with pytest.raises(BadRequest) as info:
        parse_completion(body, M)
    assert info.value.param == param
    assert param in str(info.value) or "model" in str(info.value)


def test_unsupported_defaults_are_accepted():
    r = parse_completion({"model": M, "prompt": "x", "logprobs": None, "echo": False, "best_of": 1}, M)
    assert r.prompt == "x"


def test_prompt_lists_n_echo_logprobs():
    r = parse_completion({"model": M, "prompt": ["a", "b"], "n": 3, "echo": True, "logprobs": 2, "best_of": 3}, M)
    assert (r.prompts, r.n, r.echo, r.sampling.logprobs) == (["a", "b"], 3, True, 2)
    r = parse_completion({"model": M, "prompt": [[1, 2], [3]], "stream": True,
                          "stream_options": {"include_usage": True}}, M)
    assert (r.prompts, r.include_usage, r.prompt_token_ids) == ([[1, 2], [3]], True, [1, 2])
    c = parse_chat({"model": M, "messages": [{"role": "user", "content": "a"}], "n": 2, "logprobs": True,
                    "top_logprobs": 4,
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "x", "schema": {"type": "object"}}}}, M)
    assert (c.n, c.sampling.logprobs, c.sampling.response_format.kind) == (2, 4, "json_schema")
    assert json.loads(c.sampling.response_format.schema) == {"type": "object"}


@pytest.mark.parametrize(
    "body",
    [{"model": M}, {"model": M, "messages": []}, {"model": M, "messages": [{"role": "robot", "content": "x"}]},
     {"model": M, "messages": [{"role": "user", "content": 3}]}],
)
def test_bad_chat_messages(body):
    with pytest.raises(BadRequest, match="messages"):
        parse_chat(body, M)


def test_invalid_json_and_non_object():
    with pytest.raises(BadRequest, match="not valid JSON"):
        parse_json(b"{nope")
    with pytest.raises(BadRequest, match="JSON object"):
        parse_json(b"[1]")


def test_response_shapes():
    r = parse_chat({"model": M, "messages": [{"role": "user", "content": "a"}]}, M)
    full = full_response(r, "hello", "stop", 3, 2)
    assert full["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert full["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    first = chunk(r, "", first=True)
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"
    assert json.loads(sse(first)[6:]) == first
    assert error_body("bad", param="x")["error"] == {"message": "bad", "type": "invalid_request_error", "param": "x",
                                                     "code": None}
