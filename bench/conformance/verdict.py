"""Verdicts (pure, unit-tested): what one check concluded, and what the whole run concluded.

A check ends in exactly one verdict:

- ``PASS``: every assertion of the check held;
- ``FAIL``: at least one did not, the check raised, or it ran past its hang guard (a hang
  is a failure, never a wait);
- ``SKIP``: the check could not apply here (no ``--kill-cmd`` for faults, no tokenizer
  endpoint, the ``openai`` package not installed, an area left out by ``--areas``); the
  detail says why. A skip never hides a failure: a check that started and found a problem
  fails.

``Problems`` collects a check's failed assertions as sentences; its ``outcome(ok_detail)``
is a FAIL naming the first few (and how many more) or a PASS with ``ok_detail``. Notes
(``note``) are facts worth reporting that do not fail the check, e.g. where a server answers
differently from OpenAI but within what the check accepts.

The run's exit status: 0 when no check failed, 1 when one did (2: the command line was wrong
or the endpoint could not be reached at all, set by the runner).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
VERDICTS = (PASS, FAIL, SKIP)
SHOWN_PROBLEMS = 3


@dataclass(slots=True)
class Outcome:
    verdict: str
    detail: str
    data: dict = field(default_factory=dict)   # structured facts for the JSON (counts, cases)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")


@dataclass(slots=True)
class Result:
    """One row of the report."""

    name: str
    area: str
    verdict: str
    detail: str
    seconds: float = 0.0
    data: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def passed(detail: str, **data) -> Outcome:
    return Outcome(PASS, detail, data)


def failed(detail: str, **data) -> Outcome:
    return Outcome(FAIL, detail, data)


def skipped(detail: str, **data) -> Outcome:
    return Outcome(SKIP, detail, data)


class Problems:
    """A check's failed assertions and notes; ``outcome`` turns them into a verdict."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self.notes: list[str] = []

    def __bool__(self) -> bool:
        return bool(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def add(self, message: str) -> None:
        self.items.append(message)

    def check(self, condition: bool, message: str) -> bool:
        """Record ``message`` when ``condition`` is false; returns the condition."""
        if not condition:
            self.items.append(message)
        return condition

    def note(self, message: str) -> None:
        if message not in self.notes:
            self.notes.append(message)

    def outcome(self, ok_detail: str, **data) -> Outcome:
        notes = f" (note: {'; '.join(self.notes)})" if self.notes else ""
        if not self.items:
            return Outcome(PASS, ok_detail + notes, data)
        shown = "; ".join(self.items[:SHOWN_PROBLEMS])
        more = f" (+{len(self.items) - SHOWN_PROBLEMS} more)" if len(self.items) > SHOWN_PROBLEMS else ""
        return Outcome(FAIL, shown + more + notes, {**data, "problems": self.items})


def summary(results: list[Result]) -> dict:
    out = {v.lower(): sum(r.verdict == v for r in results) for v in VERDICTS}
    out["total"] = len(results)
    out["failed_checks"] = [r.name for r in results if r.verdict == FAIL]
    return out


def exit_status(results: list[Result]) -> int:
    return 1 if any(r.verdict == FAIL for r in results) else 0
