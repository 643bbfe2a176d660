"""POST /tokenize and /detokenize (prefill_server/tokenize_api.py, vLLM's routes): the ids the OpenAI
routes compute for the same prompt or conversation, text back from ids, and 400s naming the field. The
Frontend is the real one over the engine's byte tokenizer; no node is needed (nothing reaches an engine)."""

import pytest

from pdserve.engine import SamplingParams
from pdserve.engine.tokenizer import ByteTokenizer
from pdserve.prefill_server import openai_api as oa
from pdserve.prefill_server.frontend import Frontend
from pdserve.prefill_server.tokenize_api import detokenize, tokenize

TOK = ByteTokenizer()
CHAT = [{"role": "user", "content": "Say something"}]


@pytest.fixture
def fe():
    return Frontend(None, TOK, SamplingParams, "tiny", 2048, vocab_size=TOK.vocab_size)


def test_a_prompt_counts_as_the_completion_route_and_without_the_bos_when_asked(fe):
    got = tokenize(fe, {"prompt": "hi there"})
    completion = oa.parse_completion({"model": "tiny", "prompt": "hi there"}, "tiny")
    assert got["tokens"] == fe.prompt_ids(completion) == [TOK.BOS, *b"hi there"]
    assert got["count"] == 9 and got["max_model_len"] == 2048 and got["token_strs"] is None
    bare = tokenize(fe, {"model": "tiny", "prompt": "hi there", "add_special_tokens": False})
    assert bare["tokens"] == list(b"hi there")


def test_messages_count_as_the_chat_route(fe):
    chat = oa.parse_chat({"model": "tiny", "messages": CHAT}, "tiny")
    assert tokenize(fe, {"messages": CHAT})["tokens"] == fe.prompt_ids(chat)


def test_detokenize_gives_the_ids_text_back(fe):
    ids = tokenize(fe, {"prompt": "héllo"})["tokens"]
    assert detokenize(fe, {"tokens": ids[1:]}) == {"prompt": "héllo"}


@pytest.mark.parametrize("answer, body, param", [
    (tokenize, {"prompt": 5}, "prompt"),
    (tokenize, {}, "prompt"),
    (tokenize, {"prompt": "a", "messages": CHAT}, "prompt"),
    (tokenize, {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    (tokenize, {"model": "other", "prompt": "a"}, "model"),
    (tokenize, {"messages": "hello"}, "messages"),
    (detokenize, {}, "tokens"),
    (detokenize, {"tokens": [1, 10**9]}, "tokens"),
    (detokenize, {"tokens": "abc"}, "tokens"),
    (detokenize, {"model": "other", "tokens": [1]}, "model"),
])
def test_bad_input_is_a_bad_request_naming_the_field(fe, answer, body, param):
    with pytest.raises(oa.BadRequest) as err:
        answer(fe, body)
    assert err.value.param == param, err.value.message
