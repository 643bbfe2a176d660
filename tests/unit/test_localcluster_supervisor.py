"""The restart state machine of `pdserve up`, driven by a fake clock and fake processes."""

from __future__ import annotations

import signal

import pytest

from pdserve.localcluster.supervisor import (RestartBackoff, ServerCannotStart, ServerExited, ServerProcess, Supervisor,
                                             describe_exit)


def test_backoff_doubles_to_the_cap():
    b = RestartBackoff(initial=0.5, cap=10.0, reset_after=30.0)
    delays = []
    now = 0.0
    for _ in range(8):
        b.on_start(now)
        b.on_ready(now + 1)
        now += 2  # dies after 2 s each time: never long enough to reset
        delays.append(b.on_exit(now))
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    assert b.restarts == 8


def test_backoff_resets_after_a_long_healthy_run():
    b = RestartBackoff(initial=0.5, cap=10.0, reset_after=30.0)
    for t in (0.0, 2.0, 4.0):
        b.on_start(t)
        b.on_ready(t + 0.5)
        b.on_exit(t + 1.0)
    assert b.next_delay == 4.0
    b.on_start(10.0)
    b.on_ready(11.0)
    assert b.on_exit(10.0 + 30.0) == 0.5  # stayed up 30 s: back to the first delay
    assert b.next_delay == 1.0


def test_gives_up_after_n_deaths_before_ready_in_a_row():
    b = RestartBackoff(max_failed_starts=3)
    b.on_start(0.0)
    assert b.on_exit(0.1) is not None
    b.on_start(1.0)
    assert b.on_exit(1.1) is not None
    b.on_start(2.0)
    assert b.on_exit(2.1) is None
    assert b.failed_starts == 3


def test_becoming_ready_clears_the_failed_starts():
    b = RestartBackoff(max_failed_starts=2)
    b.on_start(0.0)
    assert b.on_exit(0.1) is not None  # 1 failed start
    b.on_start(1.0)
    b.on_ready(2.0)
    assert b.on_exit(3.0) is not None  # died after being ready: not a failed start
    b.on_start(4.0)
    assert b.on_exit(4.1) is not None  # 1 failed start again, not 2
    assert b.failed_starts == 1


@pytest.mark.parametrize("kwargs",
                         [dict(initial=0), dict(initial=5, cap=1), dict(reset_after=0), dict(max_failed_starts=0)])
def test_backoff_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        RestartBackoff(**kwargs)


def test_describe_exit():
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(3) == "exit code 3"


class FakeProc:
    _next_pid = 100

    def __init__(self):
        FakeProc._next_pid += 1
        self.pid, self.returncode = FakeProc._next_pid, None

    def poll(self):
        return self.returncode


class World:
    """Fake spawn and /ready: tests decide which URLs answer and which processes die."""

    def __init__(self, names=("decode-0", "prefill-0"), policy="always", max_failed_starts=3, tmp_path=None):
        self.ready_urls: set[str] = set()
        self.spawned: list[str] = []
        self.lines: list[str] = []
        self.servers = [ServerProcess(n, [n], f"http://{n}/ready", tmp_path / f"{n}.log",
                                      RestartBackoff(max_failed_starts=max_failed_starts)) for n in names]
        for s in self.servers:
            s.log.write_text(f"{s.name} log line\nTraceback: boom\n")
        self.sup = Supervisor(self.servers, self.spawn, lambda url: url in self.ready_urls, policy=policy,
                              say=self.lines.append)

    def spawn(self, server):
        self.spawned.append(server.name)
        return FakeProc()

    def server(self, name):
        return next(s for s in self.servers if s.name == name)


def test_supervisor_restarts_a_dead_server_on_its_argv_and_the_others_keep_running(tmp_path):
    w = World(tmp_path=tmp_path)
    w.sup.start_all(0.0)
    w.ready_urls = {"http://decode-0/ready", "http://prefill-0/ready"}
    w.sup.step(1.0)
    assert w.sup.all_ready()
    decode, prefill = w.server("decode-0"), w.server("prefill-0")
    first_prefill = prefill.popen
    decode.popen.returncode = -signal.SIGKILL
    w.ready_urls.discard("http://decode-0/ready")
    w.sup.step(5.0)
    assert decode.state == "waiting" and decode.restart_at == 5.5
    assert len(w.lines) == 1 and "decode-0" in w.lines[0] and "SIGKILL" in w.lines[0]
    assert "restarting in 0.5s" in w.lines[0] and "restart 1" in w.lines[0]
    w.sup.step(5.2)
    assert w.spawned == ["decode-0", "prefill-0"]  # not yet due
    w.sup.step(5.6)
    assert w.spawned == ["decode-0", "prefill-0", "decode-0"] and decode.state == "starting"
    w.ready_urls.add("http://decode-0/ready")
    w.sup.step(8.0)
    assert decode.state == "ready" and "ready again" in w.lines[-1]
    assert prefill.popen is first_prefill and prefill.state == "ready"
    assert w.sup.snapshot()["decode-0"]["restarts"] == 1


def test_supervisor_gives_up_with_the_log_tail_when_a_server_cannot_start(tmp_path):
    w = World(names=("decode-0",), max_failed_starts=3, tmp_path=tmp_path)
    w.sup.start_all(0.0)
    now = 0.0
    with pytest.raises(ServerCannotStart) as info:
        for _ in range(10):
            w.server("decode-0").popen.returncode = 1
            now += 0.1
            w.sup.step(now)
            now += 20
            w.sup.step(now)  # restart is due
    msg = str(info.value)
    assert "decode-0" in msg and "3 times in a row" in msg and "Traceback: boom" in msg
    assert w.spawned.count("decode-0") == 3


def test_policy_never_raises_on_the_first_exit(tmp_path):
    w = World(policy="never", tmp_path=tmp_path)
    w.sup.start_all(0.0)
    w.server("prefill-0").popen.returncode = -signal.SIGKILL
    with pytest.raises(ServerExited, match="prefill-0.*SIGKILL"):
        w.sup.step(1.0)
    assert w.spawned == ["decode-0", "prefill-0"]


def test_unknown_policy_is_refused(tmp_path):
    with pytest.raises(ValueError, match="restart policy"):
        World(policy="sometimes", tmp_path=tmp_path)


def test_a_drained_server_is_never_restarted_and_leaves_when_it_exits(tmp_path):
    w = World(names=("decode-0", "decode-1"), tmp_path=tmp_path)
    terminated, changes, lines_then = [], [], []
    # each state change is published (servers.json, discovery files) before its log line announces it: a
    # reader that saw the line finds the files current (CI once read a stale prefills.txt after "drained")
    w.sup._terminate = terminated.append
    w.sup._on_change = lambda: (changes.append([s.name for s in w.sup.servers]), lines_then.append(list(w.lines)))
    w.sup.start_all(0.0)
    w.ready_urls = {"http://decode-0/ready", "http://decode-1/ready"}
    w.sup.step(1.0)
    victim = w.server("decode-1")
    w.sup.drain(victim)
    assert changes[-1] == ["decode-0", "decode-1"] and not any("draining" in line for line in lines_then[-1])
    assert terminated == [victim.popen] and victim.state == "draining" and "draining" in w.lines[-1]
    w.sup.step(2.0)
    assert victim in w.sup.servers                         # still finishing its requests
    victim.popen.returncode = 0
    w.sup.step(3.0)
    assert victim.state == "gone" and victim not in w.sup.servers and "drained and stopped (exit code 0)" in w.lines[-1]
    assert changes[-1] == ["decode-0"]
    assert not any("drained" in line for line in lines_then[-1])
    w.sup.step(60.0)
    assert w.spawned == ["decode-0", "decode-1"]           # never restarted
    assert w.sup.all_ready()


def test_added_servers_are_started_and_a_dead_one_drained_goes_at_once(tmp_path):
    w = World(names=("decode-0",), tmp_path=tmp_path)
    w.sup.start_all(0.0)
    extra = ServerProcess("decode-1", ["decode-1"], "http://decode-1/ready", tmp_path / "decode-1.log", role="decode")
    w.sup.add(extra, 1.0)
    assert w.spawned == ["decode-0", "decode-1"] and extra.state == "starting" and not extra.was_ready
    w.ready_urls.add("http://decode-1/ready")
    w.sup.step(2.0)
    assert extra.state == "ready" and extra.was_ready
    extra.popen.returncode = -signal.SIGKILL
    w.sup.step(3.0)                                        # crashed: waiting for its restart
    assert extra.state == "waiting"
    w.sup.drain(extra)
    assert extra.state == "gone" and extra not in w.sup.servers and "was not running" in w.lines[-1]
