"""bench/tools/conformance_vllm.py without vLLM: its command line, the greedy comparison and the kill command.

The kill command is run for real through /bin/sh on a ``sleep`` started in a session of its own
(as the Launcher starts vLLM): it must kill the whole group and exit 0 under dash too, whose
kill builtin rejects ``--``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from harness.bench_tools import TOOLS, load_bench_tool

@pytest.fixture(scope="module")
def tool():
    return load_bench_tool("conformance_vllm")


def test_first_difference(tool):
    assert tool.first_difference(["t1", "t2"], ["t1", "t2"]) is None
    assert tool.first_difference(["t1", "t2", "t3"], ["t1", "t9", "t3"]) == 1
    assert tool.first_difference(["t1"], ["t1", "t2"]) == 1  # one answer shorter: differs where it ends
    assert tool.first_difference([], []) is None


def test_runs_keep_the_kill_last_and_bad_values_are_refused(tool, capsys):
    args = tool.parse_args(["--runs", "vllm-pd,vllm-prefill-alone"])
    assert args.runs == ["vllm-prefill-alone", "vllm-pd"]
    assert tool.parse_args([]).runs == ["vllm-prefill-alone", "vllm-pd-self", "vllm-pd"]
    for bad in (["--runs", "nope"], ["--runs", ","], ["--kv-tokens", "100", "--max-model-len", "2048"]):
        with pytest.raises(SystemExit) as e:
            tool.parse_args(bad)
        assert e.value.code == 2
    capsys.readouterr()


def test_help_runs_without_vllm():
    out = subprocess.run([sys.executable, str(TOOLS / "conformance_vllm.py"), "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--vllm-extra" in out.stdout and "--runs" in out.stdout


def test_kill_group_cmd_kills_the_whole_session_under_sh(tool):
    # a shell leader with a child, in a session of their own: the group is both
    proc = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], start_new_session=True)
    try:
        time.sleep(0.3)
        done = subprocess.run(["/bin/sh", "-c", tool.kill_group_cmd(proc.pid)], capture_output=True, text=True,
                              timeout=30)
        assert done.returncode == 0, done.stdout + done.stderr
        assert proc.wait(timeout=10) == -9
        deadline = time.monotonic() + 10
        while group_alive(proc.pid) and time.monotonic() < deadline:  # the child sleep goes too (once reaped)
            time.sleep(0.1)
        assert not group_alive(proc.pid)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc.poll() is None:
            proc.wait()


def group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process of group pgid is left."""
    out = subprocess.run(["ps", "-e", "-o", "pgid=,stat="], capture_output=True, text=True).stdout
    rows = [line.split() for line in out.splitlines() if line.strip()]
    return any(row[0] == str(pgid) and not row[1].startswith("Z") for row in rows)
