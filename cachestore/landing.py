"""Receiver side of a one-sided write: the bytes are already in the region, a notification says where.

Both one-sided transports end the same way: the ``nixl`` notification thread (``nixl_receive.py``)
after a NIXL WRITE, and the TCP server on a ``WRITTEN`` frame after a same-node sender copied into
the shared region (``samenode_receive.py``). Each record names (request, layer, bind token) and the
destination slices (first block, count, CRC32C). ``land`` checks every slice against the
``EntryTable`` (request expected, token the one issued, blocks allocated to it: else counted in
``frames_rejected``, or ``binds_refused`` for a wrong token, and nothing counts as arrived), sums
the landed bytes when the record carries checksums and lets them count as arrived only when they
match (else the ``ChecksumError`` is returned for the receiver to fail the entry).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from .checksum import mismatch_text
from .entries import EntryTable
from .errors import BindRefused, ChecksumError, ProtocolError, UnknownRequestError
from .memory import KVLayout
from .wire_io import RegionIO


@dataclass(slots=True)
class Landed:
    """What ``land`` found: requests that completed a layer, slices accepted, refusals, corruptions."""

    touched: set[str] = field(default_factory=set)
    accepted: list[tuple[str, int, int, int]] = field(default_factory=list)  # (rid, layer, block, nblocks)
    refused: list[tuple[str, Exception]] = field(default_factory=list)  # (rid, why) a slice did not count
    corrupt: list[ChecksumError] = field(default_factory=list)


def land(records: Iterable[tuple], checksummed: bool, table: EntryTable, layout: KVLayout, io: RegionIO,
         counters: dict) -> Landed:
    """Turn one notification's records into arrivals (see the module docstring)."""
    out = Landed()
    bnb = layout.block_nbytes
    for rid, layer, token, slices in records:
        for block, n, crc in slices:
            try:
                table.begin_receive(rid, layer, block, n, token)
            except (UnknownRequestError, ProtocolError) as exc:
                counters["binds_refused" if isinstance(exc, BindRefused) else "frames_rejected"] += 1
                out.refused.append((rid, exc))
                continue
            bad = None
            try:
                if checksummed:
                    got = io.crc(layout.offset(layer, block), n * bnb)
                    if got != crc:
                        bad = ChecksumError(mismatch_text(rid, layer, block, n, crc, got), rid, layer)
                    else:
                        counters["frames_verified"] += 1
            finally:
                out.touched |= table.end_receive(rid, layer, block, n, bad is None)
            if bad is not None:
                out.corrupt.append(bad)
                continue
            counters["bytes_received"] += n * bnb
            counters["frames_received"] += 1
            out.accepted.append((rid, layer, block, n))
    return out
