"""The TBT-bounded batch: a decode admits a request whose KV is in only while the step it would make stays
within a time-between-tokens bound.

- ``StepShape``: what a step computes (decode rows, prompt tokens, the batch's context) and whom.
- ``StepTimeModel``: an online fit of a pure decode step's seconds against its rows and context, from
  the steps the engine measures itself (``observe``: the time between a running request's tokens, the
  gap since the step before included: ``EngineCore._observe``): least squares over ``1, rows, context``
  with older steps weighing less (``decay`` per step), and per row count the recent step time
  (``predict`` never answers less than what a batch of as many or fewer rows took: a step does not get
  faster with more rows). Until it has seen two row counts it predicts from what it saw: for a batch
  up to one row larger than any seen, what the largest one took (a lower bound: tried when within
  the bound, and its steps then teach the fit), for a larger one infinity (not yet), and before any
  step only one row.
- ``TbtBudget``: the scheduler's join gate (``Scheduler.join_gate``): ``admits(rows, ctx, seq_ctx)`` is
  True when the batch is empty, or when the step predicted with one more row and its context is within
  ``bound_s``. Requests it does not admit keep their place (and their KV) and are asked again before
  every step, first come first in.

The model is the engine's own (``EngineConfig.tbt_slo_ms`` builds both); a test hands the gate any object
with ``predict(rows, ctx_tokens) -> seconds | None``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

_FEATURES = 3  # 1, rows, context (thousands of tokens)


@dataclass(frozen=True, slots=True)
class StepShape:
    rows: int = 0  # decode rows (one token each)
    chunk_tokens: int = 0  # prompt tokens computed (prefill chunks)
    ctx_tokens: int = 0  # tokens of every sequence of the batch (what attention reads)
    ids: frozenset[str] = field(default_factory=frozenset)


def shape_of(batch: list) -> StepShape:
    """The shape of a scheduled batch (before its step ran: each sequence's ``num_new`` set)."""
    rows = chunk = ctx = 0
    for seq in batch:
        ctx += seq.num_tokens
        if seq.num_new == 1 and seq.num_computed == seq.num_tokens - 1 and seq.num_computed > 0:
            rows += 1
        else:
            chunk += seq.num_new
    return StepShape(rows, chunk, ctx, frozenset(seq.request_id for seq in batch))


class StepPredictor(Protocol):
    def predict(self, rows: int, ctx_tokens: int) -> float | None: ...


class StepTimeModel:
    """See the module docstring. ``decay``: the weight a step loses per later step; ``alpha``: the EWMA
    weight of a step in its row count's recent time."""

    def __init__(self, decay: float = 0.995, alpha: float = 0.2, min_steps: int = 8):
        self.decay, self.alpha, self.min_steps = decay, alpha, min_steps
        self._xx = [[0.0] * _FEATURES for _ in range(_FEATURES)]
        self._xy = [0.0] * _FEATURES
        self.steps = 0
        self.by_rows: dict[int, float] = {}  # rows -> recent seconds of a pure decode step

    def observe(self, rows: int, ctx_tokens: int, seconds: float) -> None:
        if rows <= 0 or seconds <= 0:
            return
        x = (1.0, float(rows), ctx_tokens / 1000.0)
        for i in range(_FEATURES):
            row = self._xx[i]
            for j in range(_FEATURES):
                row[j] = self.decay * row[j] + x[i] * x[j]
            self._xy[i] = self.decay * self._xy[i] + x[i] * seconds
        self.steps += 1
        last = self.by_rows.get(rows)
        self.by_rows[rows] = seconds if last is None else (1 - self.alpha) * last + self.alpha * seconds

    def floor(self, rows: int) -> float | None:
        """The most a batch of ``rows`` or fewer took recently (None: none seen)."""
        seen = [s for r, s in self.by_rows.items() if r <= rows]
        return max(seen) if seen else None

    def fit(self) -> list[float] | None:
        """(seconds per step, per row, per thousand context tokens), or None before two row counts."""
        if self.steps < self.min_steps or len(self.by_rows) < 2:
            return None
        ridge = 1e-9 * max(1.0, self._xx[0][0])
        a = [[self._xx[i][j] + (ridge if i == j else 0.0) for j in range(_FEATURES)] + [self._xy[i]]
             for i in range(_FEATURES)]
        return _solve(a)

    def predict(self, rows: int, ctx_tokens: int) -> float | None:
        floor = self.floor(rows)
        coef = self.fit()
        if coef is None:  # up to one row more than the largest batch seen: what fewer rows took (a lower bound)
            largest = max(self.by_rows, default=0)
            return floor if largest and rows <= largest + 1 else math.inf
        fitted = coef[0] + coef[1] * rows + coef[2] * ctx_tokens / 1000.0
        return max(fitted, floor or 0.0)


class TbtBudget:
    """The join gate of a TBT bound (module docstring)."""

    def __init__(self, bound_s: float, model: StepPredictor):
        if not bound_s > 0:
            raise ValueError(f"a TBT bound must be positive, got {bound_s} s")
        self.bound_s, self.model = bound_s, model
        self.held = 0  # admissions refused so far (a request asked again each step counts each time)

    def admits(self, rows: int, ctx_tokens: int, seq_ctx: int) -> bool:
        if rows == 0:
            return True  # a request alone always runs, whatever its steps take
        predicted = self.model.predict(rows + 1, ctx_tokens + seq_ctx)
        if predicted is None or predicted <= self.bound_s:
            return True
        self.held += 1
        return False


def _solve(a: list[list[float]]) -> list[float] | None:
    """Gaussian elimination with partial pivoting of an n x (n+1) augmented matrix; None when singular."""
    n = len(a)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-15:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for c in range(col, n + 1):
                a[r][c] -= f * a[col][c]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (a[r][n] - sum(a[r][c] * out[c] for c in range(r + 1, n))) / a[r][r]
    return out
