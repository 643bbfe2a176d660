"""Two rules of engine/ (issue 46's target), checked on every file of it, parsed (not imported):

- no function (or method) over 60 lines, its decorators and docstring included;
- no ``PDSERVE_`` name read in engine/: the engine takes its settings from EngineConfig and its
  callers, never from pdserve's environment (a docstring may name a variable its caller reads).
"""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"
MAX_LINES = 60


def _long_functions(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - min([d.lineno for d in node.decorator_list] + [node.lineno]) + 1
            if lines > MAX_LINES:
                out.append(f"{node.lineno} {node.name} ({lines} lines)")
    return out


def _pdserve_names(tree: ast.AST) -> list[str]:
    """``PDSERVE_`` in any string of the code but a docstring."""
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    return [f"{node.lineno} {node.value[:60]!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "PDSERVE_" in node.value
            and id(node) not in docs]


def _each_file(check) -> list[str]:
    files = sorted(ENGINE.rglob("*.py"))
    assert len(files) > 40  # the folder was found
    return [f"{path.relative_to(ENGINE.parent)}:{hit}" for path in files for hit in check(ast.parse(path.read_text()))]


def test_no_function_in_engine_is_over_60_lines():
    assert _each_file(_long_functions) == []


def test_engine_reads_no_pdserve_variable():
    assert _each_file(_pdserve_names) == []


def test_the_checks_find_what_they_look_for():
    """A 63-line function that reads PDSERVE_X, with a docstring naming PDSERVE_Y: both checks fire, the
    docstring is not counted."""
    src = 'import os\n\ndef f():\n    """Reads PDSERVE_Y."""\n' + "    x = 1\n" * 60 + \
          "    return os.environ.get('PDSERVE_X')\n"
    tree = ast.parse(src)
    assert _long_functions(tree) == ["3 f (63 lines)"]
    assert _pdserve_names(tree) == ["65 'PDSERVE_X'"]
