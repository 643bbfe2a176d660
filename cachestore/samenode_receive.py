"""The receiver's same-node side: its shared region offered in the endpoint, WRITTEN frames landed.

A receiver whose region can be shared (``samenode.describe``: a cpu pool in a memfd, any cuda
pool) and built with ``same_node=True`` adds the descriptor to its endpoint (``Endpoint.local``).
A sender on the same machine that maps the region copies a layer's blocks straight into it, then
sends a ``WRITTEN`` frame on its control connection (after BIND, on the same connection, so a
sender that dies leaves a bound entry that fails when the connection closes, as on tcp). The frame's
payload is a notification (``nixl_backend.encode_notif``: request, layer, bind token, slices with
their CRC32C); ``landing.land`` checks each slice against the entry table and its checksum in the
destination blocks. Then, as for a tcp DATA frame: an ACK per accepted slice (the sender counts a
layer delivered only then, so a corrupted slice is never delivered and ``wait_sent`` fails with
``ChecksumError``), ERROR rid for a slice refused, the receiver fails an entry whose bytes failed
their checksum.

One-sided, like a NIXL WRITE: the receiver cannot stop a sender's copy. A sender checks nothing
between its copy and its frame, so a frozen sender woken after the decode gave up on the request can
still copy into blocks the decode reused (the copy that was under way when it froze; the data thread
copies a request's layers only while the link is up and the request not removed from it). See the
README's "Frozen peers" for the same hazard on nixl.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .entries import EntryTable
from .errors import ChecksumError, ProtocolError, TransferError
from .frames import Frame, FrameType, encode_control, encode_header, read_payload
from .landing import land
from .memory import KVLayout, MemoryRegion
from .nixl_backend import decode_notif
from .samenode import describe
from .wire_io import RegionIO

if TYPE_CHECKING:  # pragma: no cover
    from .tcp_server import ReceiveSink, SenderConnection

log = logging.getLogger("pdserve.cachestore.receiver")


class SameNodeReceive:
    """Offer the region (``descriptor``) and land WRITTEN frames (``handle``, from a connection's thread)."""

    def __init__(self, region: MemoryRegion, layout: KVLayout, table: EntryTable, counters: dict,
                 sink: "ReceiveSink"):
        self.region, self.layout, self.table, self.counters, self.sink = region, layout, table, counters, sink
        self.descriptor = describe(region)  # {} when the region cannot be shared
        self._io: RegionIO | None = None  # made on first use (cuda: a pinned staging buffer)

    def handle(self, conn: "SenderConnection", frame: Frame, on_wait) -> None:
        """A WRITTEN frame on ``conn``: land its records, ACK or refuse each slice."""
        payload = read_payload(conn.sock, frame, on_wait)
        if not self.descriptor:
            raise ProtocolError("WRITTEN frame from a sender, but this receiver shares no region")
        checksummed, records = decode_notif(payload)
        self.counters["same_node_frames"] += 1
        if self._io is None:
            self._io = RegionIO(self.region)
        out = land(records, checksummed, self.table, self.layout, self._io, self.counters)
        self.sink.on_arrived(out.touched)
        for rid, layer, block, n in out.accepted:
            conn.send(encode_header(FrameType.ACK, rid, layer, block, n))
        for rid, exc in out.refused:  # as for a tcp DATA frame refused (tcp_server.py)
            log.warning("CacheStore WRITTEN from %s refused: %s", conn.peer, exc)
            if isinstance(exc, ProtocolError):  # a known request written outside its blocks: fail it
                self.sink.on_fail(rid, TransferError(str(exc)))
            if isinstance(getattr(exc, "cause", None), ChecksumError):
                continue  # its ERROR (checksum mismatch, the root cause) is on its way
            conn.send(encode_control(FrameType.ERROR, rid, str(exc).encode()))
        for err in out.corrupt:  # the receiver fails the entry and sends ERROR (FLAG_CHECKSUM_MISMATCH)
            self.sink.on_corrupt(err)
