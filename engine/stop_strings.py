"""Stop strings: where generated text must be cut (pure Python, no torch).

The one rule both the engine (``outputs.py``) and the prefill server's TextStream use
(OpenAI semantics):

- The text ends *before* the earliest occurrence of any stop string; the stop string itself
  is never returned.
- While no stop string has appeared, a tail of the text that could still grow into one (a
  proper prefix of a stop string) is held back, so that no client ever sees part of a stop.

``stop_cut(text, stops) -> (end, stopped)``: emit ``text[:end]``; ``stopped`` is True when a
stop string was found (then ``end`` is where it starts and the request is over).
"""

from __future__ import annotations

from collections.abc import Sequence


def stop_cut(text: str, stops: Sequence[str]) -> tuple[int, bool]:
    """``(end, stopped)``: cut at the earliest stop string, else hold back a possible start of one."""
    cut = find_stop(text, stops)
    if cut >= 0:
        return cut, True
    return len(text) - stop_prefix_len(text, stops), False


def find_stop(text: str, stops: Sequence[str]) -> int:
    """Index of the earliest occurrence of any (non-empty) stop string in ``text``, or -1."""
    return min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
