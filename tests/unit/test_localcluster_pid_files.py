"""`pdserve up --log-dir DIR` keeps DIR/<server>.pid equal to the pid of each server process that runs
now (for a shell's `kill -9 $(cat DIR/decode-0.pid)`, as bench conformance's --kill-cmd): written at each
start, gone while the server waits for its restart (no stale pid a kill could hit), once it has gone and
once `up` has stopped."""

import argparse
import signal

from pdserve.localcluster.up import LocalCluster
from pdserve.localcluster.up_args import add_arguments


class FakeProc:
    next_pid = 4000

    def __init__(self):
        FakeProc.next_pid += 1
        self.pid, self.returncode = FakeProc.next_pid, None

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        return self.returncode


def cluster(tmp_path, *argv) -> LocalCluster:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    c = LocalCluster(parser.parse_args(["--decode", "2", "--log-dir", str(tmp_path), *argv]), say=lambda line: None)
    c.supervisor._spawn = lambda server: FakeProc()  # noqa: SLF001 - no real process in a unit test
    c.supervisor._is_ready = lambda url: True  # noqa: SLF001
    return c


def pid_files(tmp_path) -> dict[str, int]:
    return {p.stem: int(p.read_text()) for p in tmp_path.glob("*.pid")}


def test_pid_files_follow_the_running_processes(tmp_path):
    c = cluster(tmp_path)
    c.start()
    pids = {s.name: s.popen.pid for s in c.supervisor.servers}
    assert pid_files(tmp_path) == pids == {n: pids[n] for n in ("decode-0", "decode-1", "prefill-0")}
    c.supervisor.step(1.0)                                   # all ready: unchanged
    victim = next(s for s in c.supervisor.servers if s.name == "decode-1")
    victim.popen.returncode = -signal.SIGKILL
    c.supervisor.step(2.0)                                   # dead, waiting for its restart: no pid file
    assert victim.state == "waiting" and "decode-1" not in pid_files(tmp_path)
    c.supervisor.step(10.0)                                  # restarted: the new pid
    assert (victim.state in ("starting", "ready")
            and pid_files(tmp_path)["decode-1"] == victim.popen.pid != pids["decode-1"])
    c.supervisor.drain(victim)                               # draining: still runs, still listed
    assert pid_files(tmp_path)["decode-1"] == victim.popen.pid
    victim.popen.returncode = 0
    c.supervisor.step(11.0)                                  # drained and gone: its file goes too
    assert "decode-1" not in pid_files(tmp_path) and set(pid_files(tmp_path)) == {"decode-0", "prefill-0"}
    for s in c.supervisor.servers:
        s.popen.returncode = 0                               # as if they had drained on SIGTERM
    c.stop()                                                 # `up` ends: no pid file outlives its process
    assert pid_files(tmp_path) == {}
