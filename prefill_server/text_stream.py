"""TextStream: token deltas -> text deltas, with stop strings cut out (pure, no I/O).

The engine stops a request when a stop string appears in its text, but in P/D mode the
tokens reach prefill from decode and prefill builds the client's text itself. This class
does that: incremental detokenization (never splitting a UTF-8 character, via the
tokenizer's IncrementalDetokenizer), holding back a tail that could be the start of a
stop string, and cutting the text before the first stop string (OpenAI semantics: the
stop string is not returned). The stop rule is the engine's (``pdserve.engine.stop_strings``).
"""

from __future__ import annotations

from pdserve.engine.stop_strings import find_stop, stop_cut


class TextStream:
    def __init__(self, detokenizer, stop: list[str] | None = None, decode=None):
        self._detok = detokenizer
        self._decode = decode  # tokenizer.decode: at the end, text of a trailing partial character
        self._ids: list[int] = []
        self._stop = [s for s in (stop or []) if s]
        self._pending = ""  # text decoded but not yet emitted (may start a stop string)
        self.text = ""  # everything emitted
        self.stopped = False  # a stop string was found; ignore anything after

    def add(self, token_ids: list[int]) -> str:
        """Text to emit for these new tokens ("" when held back or after a stop)."""
        if self.stopped or not token_ids:
            return ""
        self._ids += token_ids
        self._pending += self._detok.add(list(token_ids))
        end, self.stopped = stop_cut(self._pending, self._stop)
        if self.stopped:
            return self._emit(self._pending[:end])
        return self._emit(self._pending[:end], keep=self._pending[end:])

    def flush(self) -> str:
        """At the end of the request: whatever was held back (never a stop string)."""
        if self.stopped:
            return ""
        if self._decode is not None:  # the detokenizer may hold back an incomplete last character
            full = self._decode(self._ids)
            if full.startswith(self.text + self._pending):
                self._pending = full[len(self.text):]
        cut = find_stop(self._pending, self._stop)
        if cut >= 0:
            self.stopped = True
            return self._emit(self._pending[:cut])
        return self._emit(self._pending)

    def _emit(self, text: str, keep: str = "") -> str:
        self._pending = keep
        self.text += text
        return text
