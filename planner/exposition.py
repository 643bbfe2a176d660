"""The Prometheus text format, read (pure): ``parse(text)`` -> ``{name: [(labels, value), ...]}``.

Enough of the format for what pdserve's servers export (``prometheus_client``'s output):
``# HELP`` / ``# TYPE`` comments are skipped; a sample is ``name{a="x",b="y"} value
[timestamp]`` with label values escaped as ``\\\\``, ``\\"`` and ``\\n``; values may be ``NaN``,
``+Inf`` or ``-Inf``. A line that is not a sample raises ``ValueError`` naming its number.
The planner reads only a handful of series, so it parses without ``prometheus_client``
(which the operator, a user of the planner, must not import).
"""

from __future__ import annotations

import math

Samples = dict[str, list[tuple[dict[str, str], float]]]


def _labels(text: str, lineno: int) -> tuple[dict[str, str], int]:
    """Parse ``{a="x",...}`` starting at text[0] == '{'; return (labels, index after '}')."""
    labels: dict[str, str] = {}
    i = 1
    while True:
        while i < len(text) and text[i] in " ,":
            i += 1
        if i < len(text) and text[i] == "}":
            return labels, i + 1
        eq = text.find("=", i)
        if eq < 0 or eq + 1 >= len(text) or text[eq + 1] != '"':
            raise ValueError(f"metrics line {lineno}: bad label list {text!r}")
        name = text[i:eq].strip()
        i, value = eq + 2, []
        while i < len(text) and text[i] != '"':
            if text[i] == "\\" and i + 1 < len(text):
                value.append({"n": "\n", "\\": "\\", '"': '"'}.get(text[i + 1], text[i + 1]))
                i += 2
            else:
                value.append(text[i])
                i += 1
        if i >= len(text):
            raise ValueError(f"metrics line {lineno}: unterminated label value in {text!r}")
        labels[name] = "".join(value)
        i += 1


def _value(text: str, lineno: int) -> float:
    try:
        return float(text)  # float() reads NaN, +Inf, -Inf
    except ValueError:
        raise ValueError(f"metrics line {lineno}: {text!r} is not a number") from None


def parse(text: str) -> Samples:
    out: Samples = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        brace, space = line.find("{"), line.find(" ")
        if brace >= 0 and (space < 0 or brace < space):
            name = line[:brace]
            labels, end = _labels(line[brace:], lineno)
            rest = line[brace + end:].split()
        else:
            name, labels, rest = line[:space] if space > 0 else line, {}, line[space:].split() if space > 0 else []
        if not name or not rest:
            raise ValueError(f"metrics line {lineno}: expected 'name{{labels}} value', got {raw!r}")
        out.setdefault(name, []).append((labels, _value(rest[0], lineno)))
    return out


def total(samples: Samples, name: str, **match: str) -> float:
    """The sum of every series of ``name`` whose labels include ``match`` (NaN counts as 0)."""
    return sum(v for labels, v in samples.get(name, ()) if not math.isnan(v)
               and all(labels.get(k) == want for k, want in match.items()))
