"""The package layout: one distribution, `pdserve.*` import names, a CLI that explains itself."""

import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from harness.procs import VENV_BIN

PARTS = ["engine", "cachestore", "protos", "prefill_server", "decode_server", "operator", "router"]


def test_parts_import_under_pdserve():
    for part in PARTS:
        module = importlib.import_module(f"pdserve.{part}")
        assert Path(module.__file__).parent.name == part


def test_benchmarks_live_under_bench():
    """One home for benchmarks (issue 31 item 7): `pdserve bench NAME` and the A/B scripts are all under
    bench/ (bench/engine/, bench/cachestore/, bench/tools/, ...); no other part or tools/ keeps a
    bench*.py of its own, and `pdserve bench` reaches only modules of pdserve.bench."""
    import tomllib

    from pdserve.bench import BENCHES

    repo = Path(__file__).resolve().parents[2]
    folders = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    stray = [str(path.relative_to(repo)) for folder in [*folders, "tools"] if folder != "bench"
             for path in (repo / folder).rglob("bench*.py")]
    assert not stray, f"benchmarks outside bench/: {stray}"
    assert all(module.startswith("pdserve.bench.") for module in BENCHES.values()), BENCHES
    for module in BENCHES.values():
        assert importlib.util.find_spec(module) is not None, module


def test_operator_folder_does_not_shadow_stdlib():
    import operator

    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert Path(operator.__file__).resolve().parent == stdlib
    # A fresh interpreter started in the repository root still finds the standard library module.
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", "import operator; print(operator.__file__)"], cwd=repo,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert Path(out).resolve().parent == stdlib


def test_cli_help_lists_every_command():
    from pdserve.cli import COMMANDS

    out = subprocess.run([str(VENV_BIN / "pdserve"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for name in COMMANDS:
        assert name in out.stdout


def test_cli_unknown_command_is_an_error():
    out = subprocess.run([str(VENV_BIN / "pdserve"), "frobnicate"], capture_output=True, text=True)
    assert out.returncode != 0
    assert "invalid choice" in out.stderr


def test_free_ports_are_distinct():
    from pdserve.net import free_ports

    ports = free_ports(64)
    assert len(set(ports)) == 64 and all(0 < p < 65536 for p in ports)


def test_free_ports_are_below_the_ephemeral_range_and_bindable(monkeypatch):
    """free_ports hands out ports where no bind(0) of another process can land before its server
    binds it (below the kernel's ephemeral range on Linux), distinct, never twice, and free."""
    import socket

    from pdserve import net

    monkeypatch.delenv(net.PORTS_ENV, raising=False)  # the suite gives each worker its own slice
    ports = net.free_ports(20)
    assert len(set(ports)) == 20 and not set(ports) & set(net.free_ports(20))
    window = net._window()
    if window is not None:
        low = int(open(net.EPHEMERAL_RANGE_FILE).read().split()[0])
        assert all(net.LOWEST <= p <= min(net.HIGHEST, low - 1) for p in ports), ports
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_the_port_window_can_be_pinned_by_the_environment(monkeypatch, tmp_path):
    """PDSERVE_PORTS=LOW-HIGH keeps a process (and its children) to a slice: the test suite's workers
    never choose the same port. A malformed value is an error that names the variable."""
    import tempfile

    import pytest

    from pdserve import net

    # its own reservations (pdserve.net.RESERVE_S): the machine's would fill this small window
    # after a few runs within RESERVE_S, and the ports would come from outside it
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setenv(net.PORTS_ENV, "21000-21099")
    ports = net.free_ports(30)
    assert all(21000 <= p <= 21099 for p in ports), ports
    for bad in ("21000", "a-b", "500-600", "30000-20000"):
        monkeypatch.setenv(net.PORTS_ENV, bad)
        with pytest.raises(ValueError, match=net.PORTS_ENV):
            net.free_ports(1)


def test_a_child_process_never_hands_out_a_port_its_parent_handed_out(monkeypatch, tmp_path):
    """Ports handed out are reserved machine-wide (RESERVE_S): a test's ports for `pdserve up` and the
    ports `up` then chooses for its servers come from one window, and must not meet (CI once sent
    the test's HTTP GET to a decode's CacheStore port)."""
    import subprocess
    import sys
    import tempfile

    from pdserve import net

    monkeypatch.setenv(net.PORTS_ENV, "22400-22439")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    mine = net.free_ports(10)
    code = "from pdserve import net; print(*net.free_ports(10))"
    theirs = [int(p) for p in subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                              check=True).stdout.split()]
    assert len(theirs) == 10 and all(22400 <= p <= 22439 for p in mine + theirs), (mine, theirs)
    assert not set(mine) & set(theirs), (mine, theirs)
    assert sorted(int(p.name) for p in (tmp_path / f"pdserve-ports-{os.getuid()}").iterdir()
                  if p.name.isdigit()) == sorted(mine + theirs)


def test_test_files_have_unique_names_across_tiers():
    """The tiers' folders are not packages, so pytest imports each test file by its base name: two
    tiers with the same file name break the collection of the whole suite ("import file mismatch")."""
    tests = Path(__file__).resolve().parents[1]
    seen: dict[str, Path] = {}
    for path in sorted(tests.rglob("test_*.py")):
        assert path.name not in seen, f"{path.relative_to(tests)} and {seen[path.name].relative_to(tests)}"
        seen[path.name] = path
