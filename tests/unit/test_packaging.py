"""What a non-editable install (``pip install .``, the Dockerfile) ships: every package folder.

An editable install maps whole folders, so a subpackage missing from pyproject's list, or a
top-level folder the Dockerfile does not copy, only shows up in the image. These checks read
the files themselves.
"""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_listed_in_pyproject():
    cfg = setuptools_config()
    listed, folders = set(cfg["packages"]), set()
    for package, folder in cfg["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            folders.add(".".join([package, *rel.parts]))
    assert folders - listed == set(), \
        f"package folders a non-editable install would leave out: {sorted(folders - listed)}"
    assert listed - folders == set(), f"listed packages with no folder: {sorted(listed - folders)}"


def test_the_dockerfile_copies_every_top_level_package_folder():
    copied = set(re.findall(r"^COPY (\S+) \./\1\s*$", (ROOT / "Dockerfile").read_text(), flags=re.M))
    folders = {folder for folder in setuptools_config()["package-dir"].values()}
    assert folders - copied == set(), f"the image would be built without: {sorted(folders - copied)}"


def test_the_vllm_environment_maps_every_top_level_package():
    """`--engine vllm` re-runs the command under vLLM's python with pdserve's folders mapped one by
    one (vllm_backend/env.py): a package left out there fails only in that environment."""
    from pdserve.vllm_backend.env import SUBPACKAGES

    packages = {name.split(".", 1)[1] for name in setuptools_config()["package-dir"] if name != "pdserve"}
    assert packages == set(SUBPACKAGES), f"missing: {sorted(packages - set(SUBPACKAGES))}, " \
                                         f"no such package: {sorted(set(SUBPACKAGES) - packages)}"
