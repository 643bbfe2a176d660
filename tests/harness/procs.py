"""Helpers for tests that start real processes and servers: free ports, process groups, waits.

Every process started through ProcessGroup is killed (with its children) when the
group closes, also when the test fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def wait_for_port(port: int, host: str = "127.0.0.1", timeout: float = 60.0,
                  proc: subprocess.Popen | None = None) -> None:
    """Block until something accepts connections on host:port (or fail with a clear message)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listened on {host}:{port} within {timeout}s")


class ProcessGroup:
    """Start processes in their own sessions; close() kills them all (use as a context manager)."""

    def __init__(self, log_dir: Path | None = None):
        self.procs: list[subprocess.Popen] = []
        self.log_dir = log_dir

    def start(self, args: list[str], name: str | None = None, env: dict | None = None, **kw) -> subprocess.Popen:
        full_env = dict(os.environ)
        full_env.update(env or {})
        out = subprocess.DEVNULL
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name or len(self.procs)}.log", "wb")
        proc = subprocess.Popen(args, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def pdserve(self, *args: str, name: str | None = None, env: dict | None = None) -> subprocess.Popen:
        """Start the installed `pdserve` command with the given arguments."""
        return self.start([str(VENV_BIN / "pdserve"), *args], name=name, env=env)

    def kill(self, proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)

    def __enter__(self) -> "ProcessGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
