"""Make ``pdserve`` importable from a folder of symbolic links, without pip or setuptools.

    python3 tools/gpu/link_package.py SITE      # then: PYTHONPATH=SITE python3 -c "import pdserve.engine"

check.sh's fallback when ``pip install --target`` cannot build the package on the GPU machine
(no setuptools >= 77 there, say). pyproject.toml installs each top-level folder as a subpackage
(``[tool.setuptools] package-dir``: ``pdserve.engine`` is engine/, ...); this builds the same
tree out of links: ``SITE/pdserve/<each entry of pdserve/>`` and ``SITE/pdserve/<sub>`` -> the
folder it maps. Edits in the repository show through (an editable install, in effect).
"""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def link(site: Path) -> list[str]:
    """Build the link tree under ``site`` (replacing an earlier one); the subpackages linked."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    top = site / "pdserve"
    if top.exists() or top.is_symlink():
        shutil.rmtree(top) if top.is_dir() and not top.is_symlink() else top.unlink()
    top.mkdir(parents=True)
    for entry in (ROOT / mapping.get("pdserve", "pdserve")).iterdir():
        if entry.name != "__pycache__":
            (top / entry.name).symlink_to(entry)
    linked = []
    for package, folder in mapping.items():
        parts = package.split(".")
        if parts[0] != "pdserve" or len(parts) != 2:
            continue
        (top / parts[1]).symlink_to(ROOT / folder, target_is_directory=True)
        linked.append(package)
    return linked


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    linked = link(Path(sys.argv[1]))
    print(f"linked pdserve and {len(linked)} subpackages under {sys.argv[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
