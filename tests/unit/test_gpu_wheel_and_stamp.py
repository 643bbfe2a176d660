"""tools/gpu/slim_nixl_wheel.py and tools/gpu/tree_stamp.py (issue 51 items 2 and 5).

The slim wheel, on a wheel laid out as the published nixl-cu1X one, built here from real shared libraries
(gcc): it keeps the package, the UCX plugin, the single-machine UCX modules and exactly the libraries they
need (followed through ELF NEEDED, across folders), drops the other plugins, InfiniBand and what nothing
needs, and its RECORD lists every kept file with its true sha256 and size (pip installs it).

The tree stamp: on a machine without git, a stamp whose source hash equals the tree's gives the stamped
commit and "clean"; a tree whose sources differ gets no commit and says so; no stamp says so. Here, with git,
the refusal of uncommitted sources names them.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools" / "gpu"
sys.path.insert(0, str(TOOLS))

import slim_nixl_wheel  # noqa: E402
import tree_stamp  # noqa: E402

# file in the wheel -> the libraries it links (by file name, as the published wheel's mangled names)
LAYOUT = {
    "nixl_x/_bindings.so": ["libnixl.so"],
    ".nixl_x.mesonpy.libs/libnixl.so": ["libserdes.so"],
    ".nixl_x.mesonpy.libs/libserdes.so": [],
    ".nixl_x.mesonpy.libs/libunused.so": [],
    ".nixl_x.mesonpy.libs/plugins/libplugin_UCX.so": ["libucp-ab12.so.0.0.0", "libserdes.so"],
    ".nixl_x.mesonpy.libs/plugins/libplugin_OBJ.so": ["libaws-77.so"],
    "nixl_x.libs/libucp-ab12.so.0.0.0": ["libucs-cd34.so.0.0.0"],
    "nixl_x.libs/libucs-cd34.so.0.0.0": [],
    "nixl_x.libs/libaws-77.so": [],
    "nixl_x.libs/libibverbs-9.so.1": [],
    "nixl_x.libs/ucx/libuct_cuda.so.0.0.0": ["libucs-cd34.so.0.0.0"],
    "nixl_x.libs/ucx/libuct_cma.so.0.0.0": [],
    "nixl_x.libs/ucx/libuct_ib.so.0.0.0": ["libibverbs-9.so.1"],
}
KEPT = {"nixl_x/__init__.py", "nixl_x/_api.py", "nixl_x/_bindings.so", "nixl_x-1.0.dist-info/METADATA",
        "nixl_x-1.0.dist-info/WHEEL", "nixl_x-1.0.dist-info/RECORD", ".nixl_x.mesonpy.libs/libnixl.so",
        ".nixl_x.mesonpy.libs/libserdes.so", ".nixl_x.mesonpy.libs/plugins/libplugin_UCX.so",
        "nixl_x.libs/libucp-ab12.so.0.0.0", "nixl_x.libs/libucs-cd34.so.0.0.0",
        "nixl_x.libs/ucx/libuct_cuda.so.0.0.0", "nixl_x.libs/ucx/libuct_cma.so.0.0.0"}


def _shared_lib(path: Path, needs: list[str], lib_dir: Path) -> None:
    src = path.with_suffix(".c")
    src.write_text(f"int f_{abs(hash(path.name))}(void) {{ return 1; }}\n")
    links = [f"-l:{n}" for n in needs]
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(path), str(src), f"-L{lib_dir}", "-Wl,--no-as-needed",
                    *links], check=True)
    src.unlink()


@pytest.fixture
def published(tmp_path) -> Path:
    built = tmp_path / "built"
    built.mkdir()
    made: dict[str, Path] = {}
    while len(made) < len(LAYOUT):  # each library once every one it links is built
        for name, needs in LAYOUT.items():
            if name not in made and all((built / n).exists() for n in needs):
                made[name] = built / Path(name).name
                _shared_lib(made[name], needs, built)
    wheel = tmp_path / "pub" / "nixl_x-1.0-cp312-cp312-manylinux_2_28_x86_64.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        for name, path in made.items():
            z.write(path, name)
        z.writestr("nixl_x/__init__.py", "from ._api import *\n")
        z.writestr("nixl_x/_api.py", "AGENT = 1\n")
        z.writestr("nixl_x_ep/huge.py", "x = 1\n")
        z.writestr("nixl_x-1.0.data/headers/nixl.h", "//\n")
        z.writestr("nixl_x-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: nixl-x\nVersion: 1.0\n")
        z.writestr("nixl_x-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: cp312-cp312-x\n")
        z.writestr("nixl_x-1.0.dist-info/RECORD", "stale\n")
    return wheel


def test_the_slim_wheel_keeps_the_ucx_backend_and_what_it_needs(published, tmp_path):
    out = slim_nixl_wheel.slim(published, tmp_path / "slim", keep_ib=False)
    with zipfile.ZipFile(out) as z:
        names = set(z.namelist())
        assert names == KEPT
        rows = list(csv.reader(io.StringIO(z.read("nixl_x-1.0.dist-info/RECORD").decode())))
        for name, digest, size in rows:
            if name.endswith("RECORD"):
                assert digest == size == ""
                continue
            data = z.read(name)
            want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert digest == f"sha256={want}" and int(size) == len(data), name
        assert {r[0] for r in rows} == names


def test_keep_ib_adds_the_rdma_module_and_its_library(published, tmp_path):
    out = slim_nixl_wheel.slim(published, tmp_path / "slim", keep_ib=True)
    with zipfile.ZipFile(out) as z:
        assert set(z.namelist()) == KEPT | {"nixl_x.libs/ucx/libuct_ib.so.0.0.0", "nixl_x.libs/libibverbs-9.so.1"}


def test_a_stamp_names_the_commit_only_when_the_sources_hash_alike(tmp_path, monkeypatch):
    monkeypatch.setattr(tree_stamp, "_git", lambda *args: None)  # the GPU machine: no .git
    monkeypatch.setattr(tree_stamp, "STAMP", tmp_path / "stamp.json")
    assert tree_stamp.identity()["tree"].startswith("no git and no stamp")
    digest = tree_stamp.source_hash()
    (tmp_path / "stamp.json").write_text(json.dumps({"commit": "a" * 40, "source_sha256": digest}))
    assert tree_stamp.identity() == {"commit": "a" * 40, "source_sha256": digest,
                                     "tree": "clean (sources equal the stamp's)"}
    (tmp_path / "stamp.json").write_text(json.dumps({"commit": "b" * 40, "source_sha256": "0" * 64}))
    moved = tree_stamp.identity()
    assert moved["commit"] is None and moved["tree"].startswith("differs from the stamped commit bbbbbbbbbbbb")


def test_with_git_the_tree_says_which_sources_are_uncommitted(monkeypatch):
    monkeypatch.setattr(tree_stamp, "changed_sources", lambda: ["engine/x.py"])
    got = tree_stamp.identity()
    assert len(got["commit"]) == 40 and got["tree"] == "uncommitted changes to 1 file(s): engine/x.py"
    monkeypatch.setattr(tree_stamp, "changed_sources", lambda: [])
    assert tree_stamp.identity()["tree"] == "clean"
