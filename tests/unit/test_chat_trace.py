"""The prefix experiment's chat trace: every turn's prompt starts with the previous turn's."""

import pytest

from pdserve.bench.experiments.conversations import chat_trace


def test_each_turn_extends_the_previous_prompt_and_all_share_the_system_prompt():
    trace = chat_trace(conversations=3, turns=4, system_tokens=50, user_tokens=7, reply_tokens=5, output_tokens=2,
                       rate=2.0, think_s=0.1, vocab=256)
    assert trace.requests == 12 and len(trace.starts) == 3
    assert trace.max_prompt_tokens == 50 + 3 * (7 + 5) + 7
    for c in range(3):
        for t in range(1, 4):
            prev, cur = trace.prompt(c, t - 1), trace.prompt(c, t)
            assert cur[: len(prev)] == prev and len(cur) == len(prev) + 5 + 7
        assert trace.prompt(c, 0)[:50] == trace.system
    assert trace.prompt(0, 1) != trace.prompt(1, 1)
    assert trace == chat_trace(3, 4, 50, 7, 5, 2, 2.0, 0.1, 256)  # the same trace for every arm


@pytest.mark.parametrize("bad", [dict(conversations=0), dict(turns=0), dict(rate=0.0), dict(reply_tokens=-1)])
def test_bad_trace_parameters_are_refused(bad):
    kw = dict(conversations=1, turns=1, system_tokens=8, user_tokens=4, reply_tokens=0, output_tokens=1, rate=1.0,
              think_s=0.0, vocab=256) | bad
    with pytest.raises(ValueError):
        chat_trace(**kw)
