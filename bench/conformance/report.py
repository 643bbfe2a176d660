"""The conformance report: the printed pass/fail table and the JSON document (pure, unit-tested).

The table has one row per check (area, name, verdict, seconds, the detail cut to fit a line)
and a last line with the counts; the JSON (``--json PATH``) has every check with its full
detail and its structured data, the run's configuration and the same counts.
"""

from __future__ import annotations

from pathlib import Path

from .. import provenance
from .verdict import Result, summary

DETAIL_WIDTH = 100


def _cut(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def format_table(results: list[Result], detail_width: int = DETAIL_WIDTH) -> str:
    name_w = max([len("check")] + [len(r.name) for r in results])
    area_w = max([len("area")] + [len(r.area) for r in results])
    head = f"{'area':<{area_w}}  {'check':<{name_w}}  verdict  {'time':>7}  detail"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.area:<{area_w}}  {r.name:<{name_w}}  {r.verdict:<7}  {r.seconds:>6.1f}s  "
                     f"{_cut(r.detail, detail_width)}")
    s = summary(results)
    lines.append(f"{s['pass']} passed, {s['fail']} failed, {s['skip']} skipped of {s['total']} checks")
    return "\n".join(lines)


def format_markdown(results: list[Result], detail_width: int = DETAIL_WIDTH) -> str:
    """The same table as Markdown (docs/benchmarks.md)."""
    lines = ["| area | check | verdict | time | detail |", "|---|---|---|---|---|"]
    for r in results:
        detail = _cut(r.detail, detail_width).replace("|", "\\|")
        lines.append(f"| {r.area} | {r.name} | {r.verdict} | {r.seconds:.1f}s | {detail} |")
    return "\n".join(lines)


def document(results: list[Result], config: dict) -> dict:
    return {"tool": "pdserve bench conformance", "config": config, "summary": summary(results),
            "checks": [r.to_json() for r in results]}


def write_json(path: Path, results: list[Result], config: dict) -> Path:
    return provenance.write_json(path, document(results, config))
