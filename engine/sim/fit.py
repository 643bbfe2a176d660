"""Fit a profile's step time (``profile.StepTime``) to measured steps: least squares on relative error.

A ``Sample`` is one measured step: its prefill chunks ``(new, cached)``, its decode rows' contexts and
its seconds. ``fit_step_time(samples, fixed={...})`` returns the StepTime whose ``step_s`` is closest
to the samples in relative terms (each row weighted by 1 / seconds, so a 2 ms decode step counts as
much as a 1 s prefill), every term >= 0 (a term the fit would make negative is set to 0 and the rest
fitted again), and ``fixed`` terms held at their given values (a term the samples cannot separate,
e.g. ``prefill_pair_s`` when every prompt has one length). Pure Python: no numpy in a sim process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .profile import STEP_TERMS, StepTime


@dataclass(frozen=True, slots=True)
class Sample:
    prefills: list[tuple[int, int]]
    decode_contexts: list[int]
    seconds: float
    label: str = field(default="", compare=False)

    def features(self) -> list[float]:
        """The multiplier of each of STEP_TERMS in this step's time."""
        new = sum(n for n, _ in self.prefills)
        pairs = sum(n * (c + (n + 1) / 2) for n, c in self.prefills)
        return [1.0, float(new), float(pairs), float(len(self.decode_contexts)), float(sum(self.decode_contexts))]


def fit_step_time(samples: list[Sample], fixed: dict[str, float] | None = None) -> tuple[StepTime, dict]:
    """(the fitted StepTime, its report: samples, rms and max relative error, the worst sample's label)."""
    fixed = dict(fixed or {})
    unknown = set(fixed) - set(STEP_TERMS)
    if unknown:
        raise ValueError(f"fixed terms {sorted(unknown)} are not step terms ({', '.join(STEP_TERMS)})")
    if not samples:
        raise ValueError("no samples to fit")
    free = [t for t in STEP_TERMS if t not in fixed]
    while True:
        values = _solve(samples, free, fixed)
        negative = [t for t in free if values[t] < 0]
        if not negative:
            break
        fixed.update({t: 0.0 for t in negative})
        free = [t for t in free if t not in negative]
    step = StepTime(**values)
    errors = [(step.step_s(s.prefills, s.decode_contexts) / s.seconds - 1, s) for s in samples]
    worst = max(errors, key=lambda e: abs(e[0]))
    rms = (sum(e * e for e, _ in errors) / len(errors)) ** 0.5
    report = {"samples": len(samples), "rms_relative_error": round(rms, 4),
              "max_relative_error": round(abs(worst[0]), 4), "worst_sample": worst[1].label,
              "zeroed_or_fixed": sorted(t for t in STEP_TERMS if t not in free)}
    return step, report


def _solve(samples: list[Sample], free: list[str], fixed: dict[str, float]) -> dict[str, float]:
    """Weighted least squares for the ``free`` terms (normal equations), the ``fixed`` ones subtracted."""
    index = {t: i for i, t in enumerate(STEP_TERMS)}
    rows, targets = [], []
    for s in samples:
        if s.seconds <= 0:
            raise ValueError(f"sample {s.label or s} has {s.seconds} seconds: must be > 0")
        x = s.features()
        w = 1.0 / s.seconds
        rows.append([x[index[t]] * w for t in free])
        targets.append((s.seconds - sum(v * x[index[t]] for t, v in fixed.items())) * w)
    n = len(free)
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    atb = [sum(r[i] * y for r, y in zip(rows, targets)) for i in range(n)]
    solution = _gauss(ata, atb) if n else []
    return {**fixed, **dict(zip(free, solution))}


def _gauss(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve ``a x = b`` (Gaussian elimination, partial pivoting) with a tiny ridge on the diagonal, so a
    term no sample moves (an all-zero column) comes out 0 instead of dividing by zero."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for i in range(n):
        m[i][i] = m[i][i] * (1 + 1e-9) if m[i][i] else 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col and m[r][col]:
                f = m[r][col] / m[col][col]
                m[r] = [v - f * p for v, p in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]
