"""docs/results.md and its rows (bench/results_rows.py): every row names an existing raw file and a command
whose entry point exists, the page holds exactly the rows' tables, and `pdserve bench reproduce` reads the
published raw output back to the published figure (issue 52 items 1 and 2)."""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

from pdserve.bench import BENCHES, reproduce
from pdserve.bench.experiments import EXPERIMENTS
from pdserve.bench.results_rows import AREAS, ROWS, ResultRow, render, row, tables

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "results.md"
ROW_LINE = re.compile(r"^\| `(?P<id>[\w.-]+)` \|")


def entry_point_problem(command: str) -> str | None:
    """What is wrong with a row's command's entry point, or None."""
    argv = shlex.split(command)
    if argv[0] == "pdserve":
        if argv[1:2] != ["bench"] or len(argv) < 3 or argv[2] not in BENCHES:
            return f"not a `pdserve bench` benchmark: {argv[:3]}"
        if argv[2] == "experiment" and (len(argv) < 4 or argv[3] not in EXPERIMENTS):
            return f"no experiment {argv[3:4]}"
        return None
    if argv[0] == "python" and argv[1] == "-m":
        return None if importlib.util.find_spec(argv[2]) else f"no module {argv[2]}"
    if argv[0] in ("python", "bash"):
        return None if (REPO / argv[1]).is_file() else f"no file {argv[1]}"
    return f"unknown launcher {argv[0]!r} (pdserve, python or bash)"


def test_every_row_names_an_existing_raw_file_and_entry_point():
    assert len({r.id for r in ROWS}) == len(ROWS), "row ids repeat"
    for r in ROWS:
        assert r.raw.startswith(("docs/bench_raw/", "docs/experiments/")) and (REPO / r.raw).is_file(), r.id
        assert entry_point_problem(r.command) is None, f"{r.id}: {entry_point_problem(r.command)}"
        assert r.reads in reproduce.FIGURE_READERS, r.id


def test_results_md_holds_exactly_the_rows_tables():
    text = RESULTS.read_text()
    for area in AREAS:
        assert f"## {area}\n\n{render(area)}\n" in text, (
            f"docs/results.md's {area!r} table differs from the rows: paste `pdserve bench reproduce --tables`")
    assert text.endswith(tables())
    ids = [m["id"] for line in text.splitlines() if (m := ROW_LINE.match(line))]
    assert ids == [r.id for a in AREAS for r in ROWS if r.area == a]
    assert text.index("## P/D vs vLLM P/D") < text.index("## Engine")  # the standing against vLLM comes first


def test_the_readme_and_the_notebook_point_at_the_results_page():
    assert "docs/results.md" in (REPO / "README.md").read_text()
    assert "results.md" in (REPO / "docs" / "benchmarks.md").read_text().split("\n## ")[0]


@pytest.mark.parametrize("r", [r for r in ROWS if r.reads != "printed"], ids=lambda r: r.id)
def test_the_readers_give_the_published_figure_back_from_the_raw_output(r):
    new = reproduce.FIGURE_READERS[r.reads](REPO / Path(r.raw).parent)
    headline = re.split(r" \(|;", new)[0]  # before the per-pair detail
    numbers = re.findall(r"\d+\.\d+", headline)
    assert numbers and all(n in r.figure for n in numbers), (new, r.figure)


def test_a_rows_command_runs_here_with_out_replaced(tmp_path):
    r = row("routing-trace-prefix")
    argv = reproduce.argv_of(r, tmp_path)
    assert argv[:8] == [sys.executable, "-m", "pdserve.cli", "bench", "experiment", "trace-routing", "--prefills", "3"]
    assert argv[argv.index("--out") + 1] == str(tmp_path) and "OUT" not in argv
    assert argv[argv.index("--model") + 1] == "peer"
    with pytest.raises(KeyError, match="no row 'nope'"):
        row("nope")
    with pytest.raises(ValueError, match="area"):
        ResultRow("x", "Elsewhere", "", "", "", "", "", "", "pdserve bench engine", "docs/results.md")


def test_reproduce_lists_every_row(capsys):
    assert reproduce.run(reproduce_args(["--list"])) == 0
    listed = capsys.readouterr().out
    assert all(r.id in listed for r in ROWS)
    assert reproduce.run(reproduce_args(["nope"])) == 2


def reproduce_args(argv):
    import argparse

    parser = argparse.ArgumentParser()
    reproduce.add_arguments(parser)
    return parser.parse_args(argv)
