"""Echo with logprobs on /v1/completions, in process: the request shapes (max_tokens 0 only with
echo), the prompt's entries leading a choice's logprobs, a prompt's siblings showing the first
choice's prompt logprobs, max_tokens 0 showing none of the run token, and a resumed request not
asking for the prompt's logprobs again."""

import pytest

from pdserve.engine.logprobs import TokenLogprob
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.tokenizer import ByteTokenizer
from pdserve.prefill_server.choices import plan
from pdserve.prefill_server.frontend import Piece
from pdserve.prefill_server.openai_api import BadRequest, parse_completion
from pdserve.prefill_server.openai_logprobs import LogprobsFormatter
from pdserve.prefill_server.openai_serving import ChoiceState, PromptEcho

M = "m"
IDS = [256, *b"hi"]
PROMPT_LPS = [None, TokenLogprob(104, -2.0, ((105, -0.1), (104, -2.0))),
              TokenLogprob(105, -0.3, ((105, -0.3), (33, -4.0)))]


def test_max_tokens_zero_needs_echo():
    r = parse_completion({"model": M, "prompt": "hi", "echo": True, "logprobs": 1, "max_tokens": 0}, M)
    assert (r.echo, r.sampling.max_tokens, r.sampling.logprobs) == (True, 0, 1)
    for body in ({"prompt": "hi", "max_tokens": 0}, {"prompt": "hi", "echo": False, "max_tokens": 0},
                 {"prompt": "hi", "echo": True, "max_tokens": -1}, {"prompt": "hi", "echo": True, "max_tokens": False}):
        with pytest.raises(BadRequest) as info:
            parse_completion({"model": M, **body}, M)
        assert info.value.param == "max_tokens", body


def test_prompt_entries_lead_with_a_null_first():
    f = LogprobsFormatter("completion", ByteTokenizer(), 2)
    part = f.add_prompt(IDS, PROMPT_LPS, [0, 0, 1])
    assert part["token_logprobs"] == [None, -2.0, -0.3] and part["top_logprobs"][0] is None
    assert part["top_logprobs"][1] == {"i": -0.1, "h": -2.0} and part["tokens"][1:] == ["h", "i"]
    f.add([TokenLogprob(33, -1.0, ((33, -1.0), (34, -2.0)))], [2])
    assert f.whole()["token_logprobs"] == [None, -2.0, -0.3, -1.0] and f.whole()["text_offset"] == [0, 0, 1, 2]
    assert (LogprobsFormatter("completion", ByteTokenizer(), 0).add_prompt(IDS, PROMPT_LPS, [0, 0, 1])["top_logprobs"]
            is None)


def _states(body, n_states=1):
    parsed = parse_completion({"model": M, "prompt": IDS, "echo": True, "logprobs": 2, **body}, M)
    echo = PromptEcho("hi", IDS, ByteTokenizer())
    return [ChoiceState(parsed, i, ByteTokenizer(), echo) for i in range(n_states)]


def test_siblings_show_the_first_choices_prompt_logprobs():
    first, sibling = _states({"max_tokens": 2, "n": 2}, 2)
    text, lps = first.add(Piece([33], "!", logprobs=[TokenLogprob(33, -1.0, ((33, -1.0),))],
                                prompt_logprobs=PROMPT_LPS))
    assert text == "hi!" and lps["token_logprobs"] == [None, -2.0, -0.3, -1.0] and lps["text_offset"] == [0, 0, 1, 2]
    text, lps = sibling.add(Piece([34], '"', logprobs=[TokenLogprob(34, -1.5, ((33, -1.0),))]))
    assert text == 'hi"' and lps["token_logprobs"] == [None, -2.0, -0.3, -1.5]
    _, lps = first.add(Piece([], "", True, "length"))
    assert lps is None and first.choice()["logprobs"]["token_logprobs"] == [None, -2.0, -0.3, -1.0]


def test_max_tokens_zero_shows_the_prompt_only():
    (state,) = _states({"max_tokens": 0})
    text, lps = state.add(Piece([33], "!", logprobs=[TokenLogprob(33, -1.0, ())], prompt_logprobs=PROMPT_LPS))
    assert text == "hi" and lps["token_logprobs"] == [None, -2.0, -0.3]
    assert state.add(Piece([], "", True, "stop")) == ("", None)
    whole = state.choice()
    assert (whole["text"], whole["finish_reason"], state.tokens) == ("hi", "length", 0)
    assert len(whole["logprobs"]["tokens"]) == 3
    # the first token ended the request (a stop token): the finished piece carries the prompt
    (state,) = _states({"max_tokens": 0})
    text, lps = state.add(Piece([], "", True, "stop", prompt_logprobs=PROMPT_LPS))
    assert text == "hi" and lps["token_logprobs"] == [None, -2.0, -0.3] and state.finish_reason == "length"


def test_only_the_first_choice_asks_and_a_resume_does_not_ask_again():
    from pdserve.prefill_server.mid_stream_resume import resumed

    sp = SamplingParams(max_tokens=4, seed=1, logprobs=1, prompt_logprobs=1)
    cs = plan("r", [[1, 2], [3]], [sp, sp], 2)
    assert [c.sampling.prompt_logprobs for c in cs] == [1, None, 1, None]
    assert [c.sampling.logprobs for c in cs] == [1, 1, 1, 1] and cs[1].sampling.seed == 2
    assert resumed(sp, 0).prompt_logprobs == 1 and resumed(sp, 2).prompt_logprobs is None
