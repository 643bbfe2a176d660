"""`make lint`'s type check: mypy (pinned in pyproject's dev extra) over the packages that
``[tool.mypy] packages`` in pyproject.toml names, with that section's settings.

    python tools/typecheck.py      # exit status: mypy's (0: no errors)

Each part lives in a top-level folder that setuptools installs as ``pdserve.<part>``
(``[tool.setuptools] package-dir``); the editable install maps them with an import hook, which
mypy does not run. So this lays out the installed shape as symbolic links, ``pdserve/<file>`` for
the runtime's files and ``pdserve/<part> -> <part>/``, in a folder of the cache
(``${PDSERVE_CACHE:-~/.cache/pdserve}/typecheck/<the checkout's hash>``, with mypy's own cache
beside it; rebuilt on every run, a few milliseconds), runs mypy there, and prints its report with
the repository's paths (``engine/x.py``, not ``pdserve/engine/x.py``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def package_dirs(pyproject: Path = REPO / "pyproject.toml") -> dict[str, str]:
    """Top-level import package -> its folder in the repository (``pdserve.engine`` -> ``engine``)."""
    with pyproject.open("rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {name: folder for name, folder in mapping.items() if name.count(".") == 1}


def link_tree(dest: Path, repo: Path = REPO) -> Path:
    """``dest/pdserve`` shaped as installed, every entry a link into ``repo``; returns ``dest``."""
    shutil.rmtree(dest, ignore_errors=True)
    root = dest / "pdserve"
    root.mkdir(parents=True)
    for entry in (repo / "pdserve").iterdir():
        (root / entry.name).symlink_to(entry)
    for name, folder in package_dirs(repo / "pyproject.toml").items():
        (root / name.split(".", 1)[1]).symlink_to(repo / folder, target_is_directory=True)
    return dest


def repo_paths(line: str, repo: Path = REPO) -> str:
    """A mypy report line with the link tree's path (``pdserve/engine/x.py``) as the repository's."""
    if not line.startswith("pdserve/"):
        return line
    rest = line[len("pdserve/"):]
    part = rest.split("/", 1)[0]
    dirs = {name.split(".", 1)[1]: folder for name, folder in package_dirs(repo / "pyproject.toml").items()}
    return f"{dirs[part]}/{rest.split('/', 1)[1]}" if part in dirs and "/" in rest else line


def main() -> int:
    cache = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve")) / "typecheck"
    work = cache / hashlib.sha256(str(REPO).encode()).hexdigest()[:12]
    tree = link_tree(work / "tree")
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"), "--cache-dir",
           str(work / "mypy_cache")]
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    for line in (proc.stdout + proc.stderr).splitlines():
        print(repo_paths(line))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
