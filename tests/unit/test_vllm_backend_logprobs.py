"""vllm_backend/logprobs.py: vLLM's logprob dicts in the built-in engine's TokenLogprob shape (no vLLM needed:
its Logprob is stood in for by a namedtuple with the same fields)."""

from __future__ import annotations

from collections import namedtuple

import pytest

from pdserve.engine.logprobs import TokenLogprob
from pdserve.vllm_backend.logprobs import prompt_logprobs, sample_logprobs, token_logprob

Logprob = namedtuple("Logprob", "logprob rank decoded_token")


def _pos(chosen: tuple[int, float, int], *top: tuple[int, float]) -> dict:
    """vLLM's dict of one position: the chosen token first (its rank), then the top k (ranks 1..k)."""
    out = {chosen[0]: Logprob(chosen[1], chosen[2], None)}
    for rank, (t, lp) in enumerate(top, 1):
        out[t] = Logprob(lp, rank, None)
    return out


def test_chosen_among_the_top_k():
    assert (token_logprob(5, _pos((5, -0.1, 1), (5, -0.1), (7, -2.0)), 2)
            == TokenLogprob(5, -0.1, ((5, -0.1), (7, -2.0))))


def test_chosen_outside_the_top_k_is_not_an_alternative():
    pos = _pos((9, -5.0, 4), (5, -0.1), (7, -2.0))
    assert token_logprob(9, pos, 2) == TokenLogprob(9, -5.0, ((5, -0.1), (7, -2.0)))


def test_zero_alternatives():
    assert token_logprob(9, _pos((9, -5.0, 4)), 0) == TokenLogprob(9, -5.0, ())


def test_one_per_token_and_mismatches_are_refused():
    positions = [_pos((1, -0.5, 1), (1, -0.5)), _pos((2, -0.7, 1), (2, -0.7))]
    assert [lp.token_id for lp in sample_logprobs([1, 2], positions, 1)] == [1, 2]
    assert sample_logprobs([1, 2], None, None) is None
    with pytest.raises(ValueError, match="2 positions for 3 tokens"):
        sample_logprobs([1, 2, 3], positions, 1)
    with pytest.raises(ValueError, match="no logprob for token 4"):
        token_logprob(4, positions[0], 1)


def test_prompt_logprobs_start_with_none():
    got = prompt_logprobs([3, 4], [None, _pos((4, -1.5, 2), (8, -0.3))], 1)
    assert got == [None, TokenLogprob(4, -1.5, ((8, -0.3),))]
    assert prompt_logprobs([3, 4], None, 1) is None
