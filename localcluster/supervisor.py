"""Keep the servers of ``pdserve up`` running, the way a Deployment keeps its pods.

Lifecycle of one supervised server (``ServerProcess``):

1. **spawn** -> *starting*: the process runs; its /ready does not answer 200 yet.
2. *starting* -> *ready*: /ready answered 200 once (the start counts as good).
3. **exit** (from any state): ``RestartBackoff.on_exit`` decides
   - restart after a delay: 0.5 s, doubling on each exit up to a 10 s cap; back to
     0.5 s when the run that just ended had stayed up ``reset_after`` seconds;
   - or give up: the server died before ever becoming ready ``max_failed_starts``
     times in a row, so it cannot start at all (bad flag, port taken, broken model).
     ``ServerCannotStart`` names it and carries the tail of its log.
4. *waiting* -> **spawn** again with the same argv: the same ports, so the prefills'
   static decode lists and load-report polls find it again.

Scaling (``pdserve up --autoscale``): ``add(server, now)`` spawns one more server;
``drain(server)`` moves it to *draining* and sends its process group SIGTERM (the server
stops taking new work and finishes what it has); when it exits it is never restarted: it
goes to *gone* and leaves ``servers`` (``on_change`` runs, so its address leaves discovery
only then). A server that is not running when drained goes at once.

With policy ``never`` the first exit raises ``ServerExited`` (the old behaviour of
``pdserve up``: stop everything; for debugging). ``RestartBackoff`` is pure (every call
takes ``now``), so unit tests drive it with a fake clock; ``Supervisor.step(now)`` is one
pass of the watching loop (reap exits, restart what is due, probe what is starting) and
``pdserve up`` calls it a few times a second from its main thread.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

POLICIES = ("always", "never")


@dataclass(slots=True)
class RestartBackoff:
    """When to restart one server after it exits, and when to stop trying."""

    initial: float = 0.5
    cap: float = 10.0
    reset_after: float = 30.0
    max_failed_starts: int = 5
    restarts: int = 0           # restarts so far
    failed_starts: int = 0      # exits in a row before ever becoming ready
    next_delay: float = 0.0
    started_at: float = 0.0
    ready: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.initial <= self.cap:
            raise ValueError(f"need 0 < initial ({self.initial}) <= cap ({self.cap})")
        if self.reset_after <= 0:
            raise ValueError(f"reset_after must be > 0, got {self.reset_after}")
        if self.max_failed_starts < 1:
            raise ValueError(f"max_failed_starts must be >= 1, got {self.max_failed_starts}")
        self.next_delay = self.initial

    def on_start(self, now: float) -> None:
        self.started_at, self.ready = now, False

    def on_ready(self, now: float) -> None:  # noqa: ARG002 - same shape as the other events
        self.ready, self.failed_starts = True, 0

    def on_exit(self, now: float) -> float | None:
        """The delay before the next start, or None: give up (it never became ready, N times in a row)."""
        if now - self.started_at >= self.reset_after:
            self.next_delay = self.initial  # it had been healthy for a while: this is a fresh failure
        if not self.ready:
            self.failed_starts += 1
            if self.failed_starts >= self.max_failed_starts:
                return None
        delay = self.next_delay
        self.next_delay = min(self.cap, delay * 2)
        self.restarts += 1
        return delay


def describe_exit(returncode: int) -> str:
    """'killed by SIGKILL' or 'exit code 1' (Popen gives -N for signal N)."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def sigterm_group(proc: subprocess.Popen) -> None:
    """SIGTERM a server's process group (servers run in their own sessions)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


class ServerExited(RuntimeError):
    """Policy 'never': a server exited, so everything stops."""


class ServerCannotStart(RuntimeError):
    """A server died before becoming ready too many times in a row."""


@dataclass
class ServerProcess:
    """One server `pdserve up` runs: its fixed command line, ready URL and log file."""

    name: str
    argv: list[str]
    ready_url: str
    log: Path
    backoff: RestartBackoff = field(default_factory=RestartBackoff)
    popen: subprocess.Popen | None = None
    state: str = "new"          # new | starting | ready | waiting | draining | gone
    restart_at: float = 0.0
    role: str = ""              # prefill | decode | router
    address: str = ""           # what discovery lists for it (host:grpc_port)
    metrics_url: str = ""
    was_ready: bool = False     # became ready once: from then on discovery lists it, until it is gone

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError as e:
            return f"(no log: {e})"


class Supervisor:
    """Watches ServerProcesses; ``spawn(server)`` starts one, ``is_ready(url)`` probes /ready."""

    def __init__(self, servers: list[ServerProcess], spawn: Callable[[ServerProcess], subprocess.Popen],
                 is_ready: Callable[[str], bool], policy: str = "always", say: Callable[[str], None] = print,
                 on_change: Callable[[], None] = lambda: None,
                 terminate: Callable[[subprocess.Popen], None] | None = None):
        if policy not in POLICIES:
            raise ValueError(f"restart policy must be one of {POLICIES}, got {policy!r}")
        self.servers, self.policy = servers, policy
        self._spawn, self._is_ready, self._say, self._on_change = spawn, is_ready, say, on_change
        self._terminate = terminate or sigterm_group

    def start_all(self, now: float) -> None:
        for server in self.servers:
            self._start(server, now)

    def all_ready(self) -> bool:
        return all(s.state == "ready" for s in self.servers if s.state != "draining")

    def add(self, server: ServerProcess, now: float) -> None:
        """Supervise one more server, started now."""
        self.servers.append(server)
        self._start(server, now)

    def drain(self, server: ServerProcess) -> None:
        """SIGTERM ``server`` (it drains, then exits) and never restart it; it leaves when it exits."""
        if server not in self.servers or server.state in ("draining", "gone"):
            return
        running = server.popen is not None and server.popen.poll() is None
        server.state = "draining"
        if running:
            self._terminate(server.popen)
            self._changed(f"{server.name} (pid {server.popen.pid}) draining")
        else:
            self._gone(server, "was not running")

    def _gone(self, server: ServerProcess, how: str) -> None:
        server.state = "gone"
        self.servers.remove(server)
        self._changed(f"{server.name} drained and stopped ({how})")

    def step(self, now: float) -> None:
        """One pass: reap exits (restart, give up or raise), start what is due, probe what is starting."""
        for server in list(self.servers):
            if server.state == "draining":
                if server.popen.poll() is not None:
                    self._gone(server, describe_exit(server.popen.returncode))
            elif server.state in ("starting", "ready") and server.popen.poll() is not None:
                self._exited(server, now)
            elif server.state == "waiting" and now >= server.restart_at:
                self._start(server, now)
            elif server.state == "starting" and self._is_ready(server.ready_url):
                server.state, server.was_ready = "ready", True
                server.backoff.on_ready(now)
                self._changed(f"{server.name} is ready again (restart {server.backoff.restarts})"
                              if server.backoff.restarts else None)

    def _start(self, server: ServerProcess, now: float) -> None:
        server.popen = self._spawn(server)
        server.backoff.on_start(now)
        server.state = "starting"
        self._changed()

    def _exited(self, server: ServerProcess, now: float) -> None:
        how = describe_exit(server.popen.returncode)
        was_ready = server.state == "ready"
        if self.policy == "never":
            raise ServerExited(f"{server.name} exited ({how}); --restart never, so everything stops "
                               f"(log: {server.log})")
        delay = server.backoff.on_exit(now)
        if delay is None:
            raise ServerCannotStart(
                f"{server.name} cannot start: it exited before becoming ready {server.backoff.failed_starts} times "
                f"in a row (last: {how}). Its log ({server.log}) ends with:\n{server.log_tail()}")
        server.state, server.restart_at = "waiting", now + delay
        self._changed(f"{server.name} (pid {server.popen.pid}) {how}{'' if was_ready else ' before it was ready'}; "
                      f"restarting in {delay:.1f}s (restart {server.backoff.restarts})")

    def _changed(self, line: str | None = None) -> None:
        """Publish the new state (servers.json, the discovery files), then announce it: a reader who saw
        the line finds the files current (CI once read a stale prefills.txt after "drained and stopped")."""
        self._on_change()
        if line is not None:
            self._say(f"[supervisor] {line}")

    def snapshot(self) -> dict:
        """JSON-ready state of every server (``pdserve up`` writes it to <log-dir>/servers.json for tools)."""
        return {s.name: {"pid": s.popen.pid if s.popen else None, "state": s.state, "ready_url": s.ready_url,
                         "restarts": s.backoff.restarts, "log": str(s.log), "role": s.role, "address": s.address}
                for s in self.servers}
