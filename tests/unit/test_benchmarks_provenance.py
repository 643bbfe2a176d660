"""Every figure in docs/benchmarks.md says where it came from (issue 33 item 5).

A `##`, `###` or `####` section whose own text states a measured figure (a number with a unit:
ms, s, x, %, req/s, tok/s, GiB/s, ...) carries one line

    *Provenance: DATE; MACHINE; COMMIT; RAW.*

DATE begins with YYYY-MM-DD; MACHINE names the CPU or GPU, or says "CPU not recorded"; COMMIT is
"commit <hash> ..." or "commit not recorded ..."; RAW is "raw: <paths>" (committed output) or
"raw output not kept: ..." (with the command to rerun). Every repository path the line names
(under docs/, tools/ or bench/, `{a,b}` and `*` allowed) must exist.
"""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "docs" / "benchmarks.md"

HEADING = re.compile(r"^#{2,4} ")
FIGURE = re.compile(r"\d(?:\.\d+)?(?:x|%|\s?(?:ms|s|req/s|tok/s|tokens/s|GiB/s|MiB/s|GB/s))(?![\w/])")
PROVENANCE = re.compile(
    r"^\*Provenance: (?P<date>\d{4}-\d{2}-\d{2}[^;]*); (?P<machine>[^;]+); "
    r"(?P<commit>commit (?:[0-9a-f]{7,40}|not recorded)[^;]*); "
    r"(?P<raw>(?:raw: |raw output not kept).*)\.\*$")
PATH = re.compile(r"(?<![\w/.-])(?:docs|tools|bench)/[\w.{},*/-]+")


def sections():
    """(heading, lines of its own text) for every ##/###/#### heading, in order."""
    found = []
    for line in BENCHMARKS.read_text().splitlines():
        if HEADING.match(line):
            found.append((line, []))
        elif found:
            found[-1][1].append(line)
    return found


def expand(path):
    """docs/x.{json,png} -> docs/x.json, docs/x.png (one brace group after another)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in expand(path[:m.start()] + alt + path[m.end():])]


def exists(path):
    return any(REPO.glob(path)) if "*" in path else (REPO / path).exists()


def test_figure_pattern():
    for text in ["1.05x", "82%", "0.12 req/s", "3.51 GiB/s", "25 tok/s", "240 s", "5.1s", "66.2 ms"]:
        assert FIGURE.search(text), text
    for text in ["4 x 640", "2 cores", "x86-64-v3", "issue 16", "16,384 tokens", "s3://bucket"]:
        assert not FIGURE.search(text), text


def test_the_parser_sees_the_sections():
    headings = [heading for heading, _ in sections()]
    assert "## Engine" in headings and "## Serving experiments" in headings
    assert len(headings) >= 40


def test_every_section_with_a_figure_names_its_provenance():
    missing, malformed = [], []
    for heading, lines in sections():
        lines_with_tag = [line for line in lines if line.startswith("*Provenance:")]
        malformed += [f"{heading}: {line[:80]}" for line in lines_with_tag if not PROVENANCE.match(line)]
        text = "\n".join(line for line in lines if line not in lines_with_tag)
        if FIGURE.search(text) and len([line for line in lines_with_tag if PROVENANCE.match(line)]) != 1:
            missing.append(heading)
    assert not malformed, "provenance lines not in the format " + PROVENANCE.pattern + ":\n" + "\n".join(malformed)
    assert not missing, "sections with a figure and not exactly one provenance line:\n" + "\n".join(missing)


def test_every_path_a_provenance_line_names_exists():
    absent = []
    for heading, lines in sections():
        for line in lines:
            if not PROVENANCE.match(line):
                continue
            for token in PATH.findall(line.strip("*")):  # the line's own italics are no glob
                for path in expand(token.rstrip(".,")):
                    if not exists(path):
                        absent.append(f"{heading}: {path}")
    assert not absent, "paths named in provenance lines that are not in the repository:\n" + "\n".join(absent)
