"""Network helpers shared by the local cluster, the tools and the tests."""

from __future__ import annotations

import socket
import threading

# Ports this process has handed out. The OS may give a port back to bind(0) as soon as our
# probe socket closes, before the server it was meant for has bound it; never handing the same
# port out twice keeps two servers started by one process (a test, `pdserve up`) apart.
_handed_out: set[int] = set()
_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on right now and that this process has not
    handed out before (the caller binds it soon after)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports, none handed out before by this process."""
    socks, chosen = [], []
    try:
        with _lock:
            while len(chosen) < n:
                s = socket.socket()
                socks.append(s)
                s.bind((host, 0))
                port = s.getsockname()[1]
                if port not in _handed_out:
                    chosen.append(port)
                    _handed_out.add(port)
        return chosen
    finally:
        for s in socks:
            s.close()
