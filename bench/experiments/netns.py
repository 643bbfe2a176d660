"""Two network namespaces joined by a veth pair, shaped with `tc` (experiments only).

``LinkedNamespaces(rate_mbit)`` creates namespaces ``<prefix>-p`` (10.<n>.0.1) and
``<prefix>-d`` (10.<n>.0.2), a veth pair between them, loopback up in both, and a token
bucket filter (``tc qdisc ... tbf rate <rate>mbit``) on both ends, so each direction is
limited to the rate. Leaving the ``with`` block (also on error or Ctrl-C) deletes both
namespaces, which removes the veth pair and the qdiscs. Needs root (CAP_NET_ADMIN).
Stale namespaces of an earlier interrupted run with the same prefix are removed first.
"""

from __future__ import annotations

import os
import subprocess


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class LinkedNamespaces:
    def __init__(self, rate_mbit: float, prefix: str = "pdx", subnet: int = 201):
        if rate_mbit <= 0:
            raise ValueError(f"link rate must be > 0 Mbit/s, got {rate_mbit}")
        if not 1 <= subnet <= 254:
            raise ValueError("subnet must be 1..254")
        self.rate_mbit = rate_mbit
        self.prefill_ns, self.decode_ns = f"{prefix}-p", f"{prefix}-d"
        self.prefill_ip, self.decode_ip = f"10.{subnet}.0.1", f"10.{subnet}.0.2"
        self._veth = (f"{prefix}vp", f"{prefix}vd")

    def __enter__(self) -> "LinkedNamespaces":
        if os.geteuid() != 0:
            raise PermissionError("network namespaces need root (CAP_NET_ADMIN)")
        self._delete()
        try:
            for ns in (self.prefill_ns, self.decode_ns):
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            vp, vd = self._veth
            _ip("link", "add", vp, "type", "veth", "peer", "name", vd)
            for dev, ns, addr in ((vp, self.prefill_ns, self.prefill_ip), (vd, self.decode_ns, self.decode_ip)):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                # burst: enough for the rate at a 250 Hz timer, at least 32 KiB; queue up to 100 ms
                burst = max(32 * 1024, int(self.rate_mbit * 1e6 / 8 / 250))
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                                "rate", f"{self.rate_mbit}mbit", "burst", str(burst), "latency", "100ms"],
                               capture_output=True, text=True, check=True)
        except subprocess.CalledProcessError as e:
            self._delete()
            raise RuntimeError(f"setting up namespaces failed: {' '.join(e.cmd)}: {e.stderr.strip()}") from None
        except BaseException:
            self._delete()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._delete()

    def _delete(self) -> None:
        for ns in (self.prefill_ns, self.decode_ns):
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self._veth[0], check=False)  # if it never moved into a namespace

    def exists(self) -> bool:
        names = _ip("netns", "list", check=False).stdout
        return any(line.split()[0] in (self.prefill_ns, self.decode_ns) for line in names.splitlines() if line.strip())
