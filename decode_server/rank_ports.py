"""The ports of the decode's per-rank push receivers (``rank_receivers.py``): which, checked before anything starts.

``--kv-rank-ports PORTS`` names them: a comma list of ports and ranges (``50061-50064,50070``), in the order
they are used: rank 0..N-1's receivers first (tensor-parallel size N > 1; at size 1 the rank's receiver is the
one on ``--kv-port``), then the receivers of head slices (``engine/tp/pieces.py``), in the order they are made
(at the first request that needs each); a slice made once the list is used up listens on a free port the system
picks (fine on one machine; a NetworkPolicy admits only the listed ports). Without the flag, rank r's receiver is
on ``--kv-port`` + 1 + r and the slices' on the ``defaults.KV_SLICE_PORTS`` ports after those (a TP 1 decode's
from ``--kv-port`` + 1), which the operator's NetworkPolicy admits (``operator/pools.py``), then free ports.

At start, before the model loads: a port listed twice, a port that is one of the server's own (``--port``,
``--http-port``, ``--kv-port``, ``--kv-pool-port`` with ``--kv-pool``), fewer ports than ranks, or a port another
process holds now ends the decode with one line naming the port and the flag; the ranks' default ports are
checked the same way (a clash names ``--kv-rank-ports`` as the way out). The slices' default ports are not
checked at start (most decodes never make a slice): one of the server's own is skipped, and one another process
holds when the slice is made fails that request's Session naming the port.
"""

from __future__ import annotations

import argparse
import socket

from pdserve import defaults


def parse_ports(text: str) -> list[int]:
    """``--kv-rank-ports``' value: ports and ``A-B`` ranges, comma-separated, in order (argparse type)."""
    ports: list[int] = []
    for item in (part.strip() for part in text.split(",")):
        try:
            lo, _, hi = item.partition("-")
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not a port or a range A-B") from None
        if not 1 <= first <= last <= 65535:
            raise argparse.ArgumentTypeError(f"{item!r} is not a port range within 1-65535 (first <= last)")
        ports.extend(range(first, last + 1))
    return ports


def rank_ports(args, ranks: int) -> list[int]:
    """The ports of the per-rank push's receivers in use order (the ranks' first, at N > 1), checked against each
    other and the server's own ports; SystemExit naming the clash. [] at size 1 without the flag (the rank's
    receiver is the one on --kv-port, slices take free ports); with --kv-port 0 and no flag, ephemeral ports."""
    listed = getattr(args, "kv_rank_ports", None)
    flag = "--kv-rank-ports" if listed is not None else f"--kv-port {args.kv_port} + 1 + rank (the default)"
    if listed is None:
        listed = [args.kv_port + 1 + r for r in range(ranks)] if ranks > 1 and args.kv_port else []
    if ranks > 1 and listed and len(listed) < ranks:
        raise SystemExit(f"pdserve decode: --kv-rank-ports lists {len(listed)} port(s) for {ranks} tensor-parallel "
                         f"ranks: list at least one per rank (then one per head slice)")
    seen: set[int] = set()
    for port in listed:
        if port in seen:
            raise SystemExit(f"pdserve decode: port {port} appears twice in --kv-rank-ports")
        seen.add(port)
    own = {"--port": args.port, "--http-port": args.http_port, "--kv-port": args.kv_port}
    if getattr(args, "kv_pool", ""):
        own["--kv-pool-port"] = args.kv_pool_port
    for name, port in own.items():
        if port and port in seen:
            raise SystemExit(f"pdserve decode: {flag} includes port {port}, which is {name}: give the per-rank push "
                             f"receivers other ports (--kv-rank-ports)")
    return listed


def default_slice_ports(args, ranks: int) -> list[int]:
    """The slices' ports without --kv-rank-ports: the KV_SLICE_PORTS after the ranks' (none of the server's own);
    [] with the flag or with --kv-port 0 (free ports)."""
    if getattr(args, "kv_rank_ports", None) is not None or not args.kv_port:
        return []
    first = args.kv_port + 1 + (ranks if ranks > 1 else 0)
    own = {args.port, args.http_port, args.kv_port, args.kv_pool_port if getattr(args, "kv_pool", "") else 0}
    return [port for port in range(first, first + defaults.KV_SLICE_PORTS) if port not in own and port <= 65535]


def check_free(host: str, ports: list[int]) -> None:
    """Each port can be listened on now (SystemExit naming the first that cannot: another process holds it)."""
    for port in ports:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                raise SystemExit(f"pdserve decode: port {port} of the per-rank push receivers (--kv-rank-ports, "
                                 f"default --kv-port + 1 + rank) cannot be used on {host}: {exc.strerror or exc}"
                                 ) from None


class PortList:
    """The listed ports handed out in order (the ranks' receivers, then slices'); 0 once used up."""

    def __init__(self, ports: list[int]):
        self._ports = list(ports)

    def take(self) -> int:
        return self._ports.pop(0) if self._ports else 0
