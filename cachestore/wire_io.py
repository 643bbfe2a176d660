"""Moving region bytes to and from a socket without an intermediate copy of a layer.

cpu regions: ``sendall``/``recv_into`` on memoryview slices of the registered region, so the
kernel copies straight between the socket and the KV blocks. cuda regions (tcp has no
GPUDirect): bytes go through one pinned host staging buffer per socket thread, ``STAGE_BYTES``
at a time, never a whole layer.

Checksums (``checksum.py``): ``crc`` sums a range of the region (cpu: straight from the
region; cuda: through the staging buffer); ``recv`` sums each piece right after it landed,
while it is still in cache.
"""

from __future__ import annotations

import socket

from .checksum import crc32c
from .frames import discard, recv_exact_into
from .memory import MemoryRegion

STAGE_BYTES = 4 << 20
PIECE_BYTES = 1 << 20  # receive granularity: a deleted entry stops receiving within one piece


class RegionIO:
    """Per-thread helper bound to one region (holds that thread's staging buffer for cuda)."""

    def __init__(self, region: MemoryRegion):
        self.region = region
        self._view = region.host_view() if region.device == "cpu" else None
        self._dev = None
        self._stage = None
        if region.device == "cuda":
            import torch

            self._dev = region.owner.reshape(-1).view(torch.uint8)
            self._stage = torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=True)
            self._stage_view = memoryview(self._stage.numpy()).cast("B")

    def crc(self, offset: int, nbytes: int) -> int:
        """CRC32C of nbytes of the region from offset."""
        if self._view is not None:
            return crc32c(self._view[offset:offset + nbytes])
        value, done = 0, 0
        while done < nbytes:
            n = min(STAGE_BYTES, nbytes - done)
            self._stage[:n].copy_(self._dev[offset + done:offset + done + n])
            value = crc32c(self._stage_view[:n], value)
            done += n
        return value

    def copy_out(self, offset: int, nbytes: int) -> bytearray:
        """A host copy of nbytes of the region from offset (the corruption test hook sends one)."""
        if self._view is not None:
            return bytearray(self._view[offset:offset + nbytes])
        return bytearray(self._dev[offset:offset + nbytes].cpu().numpy().tobytes())

    def send(self, sock: socket.socket, offset: int, nbytes: int, header: bytes = b"", payload=None) -> None:
        """Send header then nbytes of the region from offset (cpu: one sendmsg for both).

        ``payload`` (bytes-like, nbytes long) is sent instead of the region's bytes when given
        (the corruption test hook)."""
        if payload is not None or self._view is not None:
            payload = memoryview(payload) if payload is not None else self._view[offset:offset + nbytes]
            sent = sock.sendmsg([header, payload])
            if sent < len(header):
                sock.sendall(header[sent:])
                sent = len(header)
            if sent - len(header) < nbytes:
                sock.sendall(payload[sent - len(header):])
            return
        if header:
            sock.sendall(header)
        done = 0
        while done < nbytes:
            n = min(STAGE_BYTES, nbytes - done)
            self._stage[:n].copy_(self._dev[offset + done:offset + done + n])
            sock.sendall(self._stage_view[:n])
            done += n

    def recv(self, sock: socket.socket, offset: int, nbytes: int, stop=None, scratch: memoryview | None = None,
             checksum: bool = False, on_wait=None) -> tuple[bool, int]:
        """Receive nbytes into the region at offset, PIECE_BYTES at a time.

        Before each piece ``stop()`` is asked; once it says True (the entry was deleted or
        failed meanwhile) the rest of the payload is read into ``scratch`` and dropped, so
        at most one piece lands in blocks the engine may already be reusing. Returns
        (whether every byte landed, the CRC32C of the bytes received when ``checksum``, else 0).
        ``on_wait(stalled_s)`` is called while no byte arrives (``frames._recv_into``); it may
        raise to give up on the frame (the receiver then closes the connection).
        """
        done, value = 0, 0
        while done < nbytes:
            if stop is not None and stop():
                discard(sock, nbytes - done, scratch, on_wait)
                return False, 0
            if self._view is not None:
                n = min(PIECE_BYTES, nbytes - done)
                piece = self._view[offset + done:offset + done + n]
                recv_exact_into(sock, piece, on_wait)
            else:
                n = min(STAGE_BYTES, nbytes - done)
                piece = self._stage_view[:n]
                recv_exact_into(sock, piece, on_wait)
                self._dev[offset + done:offset + done + n].copy_(self._stage[:n])
            if checksum:
                value = crc32c(piece, value)
            done += n
        return True, value
