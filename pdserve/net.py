"""Network helpers shared by the local cluster, the tools and the tests."""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
import threading
import time

# Ports this process has handed out. The OS may give a port back to bind(0) as soon as our
# probe socket closes, before the server it was meant for has bound it; never handing the same
# port out twice keeps two servers started by one process (a test, `pdserve up`) apart.
_handed_out: set[int] = set()
_lock = threading.Lock()
_rng = random.Random()
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST = 10000  # ports below this are left to fixed services
HIGHEST = 29999  # 30000-32767 is Kubernetes' NodePort range (kube-proxy may hold those ports)
# A port handed out from the window is reserved machine-wide for this long (a file per port, under
# a lock), so that a process and its children never hand out the same port: a test hands out a
# port for `pdserve up`, whose own choices for its servers come from the same window (seen in CI:
# the router's port had been given to a decode's CacheStore, and the test's GET met the KV wire).
RESERVE_S = 600.0


# `low-high`: the ports this process and its children hand out (inherited through the environment).
# Set by the test suite, one slice of the window per pytest-xdist worker, so that two workers never
# hand out the same port in the moment between choosing it and binding it.
PORTS_ENV = "PDSERVE_PORTS"


def _env_window() -> tuple[int, int] | None:
    value = os.environ.get(PORTS_ENV, "")
    if not value:
        return None
    try:
        low, high = (int(x) for x in value.split("-"))
    except ValueError:
        raise ValueError(f"{PORTS_ENV} must be LOW-HIGH (two port numbers), got {value!r}") from None
    if not 1024 <= low < high <= 65535:
        raise ValueError(f"{PORTS_ENV}={value!r}: need 1024 <= LOW < HIGH <= 65535")
    return low, high


def _window() -> tuple[int, int] | None:
    """The ports to hand out: ``PDSERVE_PORTS`` where set; else below the kernel's ephemeral range
    (where bind(0) never lands) and Kubernetes' NodePort range, or None off Linux.

    A port handed out here is bound by its server a little later, in another process; a
    bind(0) in between (another server's client socket, vLLM's TCPStore, a test's probe) takes
    ports from the ephemeral range only, so it cannot take ours. Seen before this: a decode
    over vLLM failed to start because vLLM's own bind(0) had just taken its gRPC port."""
    pinned = _env_window()
    if pinned is not None:
        return pinned
    try:
        low = int(open(EPHEMERAL_RANGE_FILE).read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    high = min(HIGHEST, low - 1)
    return (LOWEST, high) if high - LOWEST >= 1000 else None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on right now and that this process has not
    handed out before (the caller binds it soon after)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports, none handed out before by this process, nor by any process of
    this user within ``RESERVE_S``: below the ephemeral range where there is one (``_window``),
    else whatever bind(0) gives."""
    window = _window()
    chosen: list[int] = []
    with _lock, _reservations(window is not None) as reserved:
        tries = 0
        while len(chosen) < n:
            tries += 1
            port = _rng.randint(*window) if window is not None and tries < 1000 else 0
            if port in _handed_out or (port and port in reserved):
                continue
            s = socket.socket()
            try:
                s.bind((host, port))
                port = s.getsockname()[1]
            except OSError:  # in use
                continue
            finally:
                s.close()
            if port not in _handed_out:
                chosen.append(port)
                _handed_out.add(port)
                reserved.add(port)
    return chosen


class _Reserved:
    """The ports reserved by any process of this user (one file each, touched when handed out)."""

    def __init__(self, folder: str | None):
        self.folder = folder
        self.now = time.time()

    def __contains__(self, port: int) -> bool:
        if self.folder is None:
            return False
        try:
            return self.now - os.stat(os.path.join(self.folder, str(port))).st_mtime < RESERVE_S
        except OSError:
            return False

    def add(self, port: int) -> None:
        if self.folder is not None:
            with open(os.path.join(self.folder, str(port)), "w"):
                pass  # created or truncated: its mtime is now


@contextlib.contextmanager
def _reservations(use: bool):
    """The machine-wide reservations, under an exclusive lock (flock) while ports are chosen;
    none where the temp folder cannot hold them (then only this process's own choices count)."""
    folder = os.path.join(tempfile.gettempdir(), f"pdserve-ports-{os.getuid()}")
    fd = -1
    if use:
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            fd = os.open(os.path.join(folder, ".lock"), os.O_CREAT | os.O_RDWR, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            if fd >= 0:
                os.close(fd)
            fd = -1
    try:
        yield _Reserved(folder if fd >= 0 else None)
    finally:
        if fd >= 0:
            os.close(fd)  # releases the lock
