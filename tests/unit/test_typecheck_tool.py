"""tools/typecheck.py (``make lint``'s mypy run): it checks the packages as installed, from a link tree
shaped by pyproject's package-dir, and reports the repository's paths."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("typecheck_tool", REPO / "tools" / "typecheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_checked_package_is_a_folder_of_the_repository():
    tool = _tool()
    dirs = tool.package_dirs()
    with (REPO / "pyproject.toml").open("rb") as f:
        checked = tomllib.load(f)["tool"]["mypy"]["packages"]
    assert {"pdserve.engine", "pdserve.cachestore", "pdserve.prefill_server", "pdserve.decode_server",
            "pdserve.router"} <= set(checked)
    for name in checked:
        assert (REPO / dirs[name] / "__init__.py").exists(), name


def test_the_link_tree_has_the_installed_shape(tmp_path):
    tree = _tool().link_tree(tmp_path / "tree")
    root = tree / "pdserve"
    assert (root / "engine").resolve() == (REPO / "engine").resolve()
    assert (root / "router" / "prompt.py").resolve() == (REPO / "router" / "prompt.py").resolve()
    assert (root / "chat_prompt.py").resolve() == (REPO / "pdserve" / "chat_prompt.py").resolve()
    _tool().link_tree(tmp_path / "tree")  # again over the old one: rebuilt, not an error
    assert (root / "engine").is_symlink()


def test_reports_name_the_repositorys_files():
    repo_paths = _tool().repo_paths
    assert repo_paths("pdserve/engine/model.py:12: error: x  [misc]") == "engine/model.py:12: error: x  [misc]"
    assert repo_paths("pdserve/prefill_server/node.py:3: note: y") == "prefill_server/node.py:3: note: y"
    assert repo_paths("pdserve/metrics.py:5: error: z") == "pdserve/metrics.py:5: error: z"  # the runtime's own
    assert repo_paths("Success: no issues found in 9 source files") == "Success: no issues found in 9 source files"
