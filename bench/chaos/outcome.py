"""What became of one request under chaos, judged from its byte timeline (pure, unit-tested).

A ``RequestRecord`` is filled in by the load client (load.py) as the response streams in:
the send time, the time of every chunk of bytes received, the text, whether the stream
ended properly (``[DONE]`` after a finish_reason) and the error, if any. ``classify``
then gives exactly one outcome:

- ``hung``: some silence (send -> first byte, between two chunks, last chunk -> end)
  lasted longer than the deadline ``hang_s``. The client gives up after ``hang_s`` + 1 s
  of silence, so a hang is always seen, never waited on forever.
- ``failed``: it ended within the deadline with a clear error: an HTTP error status with a
  body, an SSE error event, or a connection error (the server process went away).
- ``cut``: the stream ended without ``[DONE]`` and without saying why (a server bug).
- ``wrong``: a greedy (temperature 0) request that finished with text different from the
  reference text of its prompt (computed before any fault).
- ``completed``: finished, and (when checked) equal to the reference.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

OUTCOMES = ("completed", "failed", "cut", "hung", "wrong")
# Error texts the client writes when a stream ends without a reason (see load.py).
UNCLEAR_PREFIX = "unclear:"


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it; times in seconds since the run start."""

    index: int
    prompt_key: int                 # which prompt of the pool (its reference text is under this key)
    checked: bool                   # greedy: compared with the reference
    prompt_chars: int = 0
    max_tokens: int = 0
    start: float = 0.0
    end: float | None = None
    byte_times: list[float] = field(default_factory=list)
    text: str = ""
    finished: bool = False          # saw a finish_reason and [DONE]
    error: str = ""
    outcome: str = ""

    def to_json(self) -> dict:
        out = asdict(self)
        out["first_byte"] = self.byte_times[0] if self.byte_times else None
        out["longest_silence"] = longest_silence(self)
        del out["byte_times"]  # thousands of floats per request; the summary keeps what matters
        return out


def longest_silence(rec: RequestRecord) -> float:
    """The longest time without a byte, from the send to the end (or the last byte if not ended)."""
    marks = [rec.start, *rec.byte_times]
    if rec.end is not None:
        marks.append(rec.end)
    return max((b - a for a, b in zip(marks, marks[1:])), default=0.0)


def classify(rec: RequestRecord, hang_s: float, reference: str | None) -> str:
    """The outcome of one ended request (see the module docstring)."""
    if hang_s <= 0:
        raise ValueError(f"hang_s must be > 0, got {hang_s}")
    if rec.end is None:
        raise ValueError(f"request {rec.index} has not ended; classify it once the client is done with it")
    if longest_silence(rec) > hang_s:
        return "hung"
    if not rec.finished:
        return "cut" if (not rec.error or rec.error.startswith(UNCLEAR_PREFIX)) else "failed"
    if rec.error:
        return "failed"
    if rec.checked and reference is not None and rec.text != reference:
        return "wrong"
    return "completed"


def counts(records: list[RequestRecord]) -> dict[str, int]:
    out = {o: 0 for o in OUTCOMES}
    for r in records:
        out[r.outcome] += 1
    return out


def overlaps(rec: RequestRecord, intervals: list[tuple[float, float]]) -> bool:
    """Whether the request's lifetime [start, end] meets any of the (begin, end) intervals."""
    end = rec.end if rec.end is not None else float("inf")
    return any(rec.start <= b and a <= end for a, b in intervals)
