"""A same-node link's transport: KV copied straight into the receiver's shared region, then WRITTEN.

The sender (``sender.py``) gives a link this ``SendSide`` instead of its own (``tcp`` / ``nixl``)
when the receiver's endpoint offers a shared region that this process could map
(``samenode.open_remote``). Like ``nixl`` the link has one TCP connection, the control channel
(handshake, BIND, CANCEL/ERROR, ACKs back, peer death) and a data thread of its own; unlike
``nixl`` the bytes move by a plain copy in this process (cpu: memcpy between two mappings of
shared memory; cuda: a device-to-device copy from CUDA IPC memory on a stream of the link) and the
notification is a ``WRITTEN`` frame on the control connection (``samenode_receive.py``).

The data thread: takes the consecutive chunks queued (up to ``WRITE_BYTES``; control frames go
first, so a request's BIND is on the wire before any of its bytes move), groups them back per
(request, layer) (``nixl_plan.group_layers``), copies each merged slice, sums it when checksums
are on (the CRC32C of the source, like every transport), waits for the copies (cuda) and queues
one WRITTEN frame with a record per (request, layer). The receiver checks each slice (token,
blocks, checksum in the destination) and ACKs it; the link's reader counts the layer delivered on
that ACK, as on tcp. The remote mapping is released when the thread ends (the link is down).

Test hook (``checksum.py``): a transfer marked ``corrupt`` has one byte of its first block
flipped in the receiver's region after the copy (the sender's pool is untouched; the CRC32C sent is
the true one).
"""

from __future__ import annotations

import logging
from typing import Any

from .frames import FrameType, encode_control
from .nixl_backend import encode_notif
from .nixl_plan import group_layers
from .samenode import RemoteRegion
from .scheduler import Chunk
from .wire_io import RegionIO

log = logging.getLogger("pdserve.cachestore.link")
WRITE_BYTES = 64 << 20  # chunks taken per WRITTEN frame (the frame's records are a few bytes a layer)
MAX_CHUNKS = 64


class SameNodeSend:
    """The ``SendSide`` of one same-node link (one per receiver instance: it owns that receiver's mapping)."""

    name = "samenode"
    frames_carry_data = False
    has_data_thread = True
    agent = ""

    def __init__(self, remote: RemoteRegion, remote_num_blocks: int):
        self.remote = remote
        self.remote_num_blocks = remote_num_blocks

    async def start(self) -> None:
        pass

    def connections(self, configured: int) -> int:
        return 1  # the control channel

    def run_data_thread(self, link: Any) -> None:
        cfg = link.config
        io = RegionIO(cfg.region)
        bnb = cfg.layout.block_nbytes
        max_blocks = max(cfg.chunk_blocks, WRITE_BYTES // bnb)
        try:
            while True:
                batch = link.take_chunks(max_blocks, MAX_CHUNKS, True)
                if batch is None:
                    return
                try:
                    frame = self._write(batch, cfg, io)
                finally:
                    link.chunks_done(batch, False)  # delivered on the receiver's ACKs (the reader thread)
                link.send_control(frame)
        finally:
            self.close()

    def _write(self, batch: list[Chunk], cfg: Any, io: RegionIO) -> bytes:
        """Copy the batch's slices into the receiver's region; the WRITTEN frame that tells it."""
        layout, bnb, remote = cfg.layout, cfg.layout.block_nbytes, self.remote
        records, flips = [], []
        for t, slices in group_layers(batch):
            out = []
            for s, d, n in slices:
                src, dst = layout.offset(t.layer, s), (t.layer * self.remote_num_blocks + d) * bnb
                remote.copy(src, dst, n * bnb)
                out.append((d, n, io.crc(src, n * bnb) if cfg.checksum else 0))
            if t.corrupt:  # test hook
                t.corrupt = False
                flips.append((t.layer * self.remote_num_blocks + slices[0][1]) * bnb)
                log.warning("TEST HOOK: corrupting one byte of request %r layer %d", t.key, t.layer)
            records.append((str(t.key), t.layer, t.token, out))
        remote.sync()  # every byte landed before the receiver hears of it
        for dst in flips:
            remote.flip(dst)
        return encode_control(FrameType.WRITTEN, "", encode_notif(records, cfg.checksum))

    def close(self) -> None:
        self.remote.close()
