"""Moving region bytes to and from a socket without an intermediate copy of a layer.

cpu regions: ``sendall``/``recv_into`` on memoryview slices of the registered region, so the
kernel copies straight between the socket and the KV blocks. cuda regions (tcp has no
GPUDirect): bytes go through one pinned host staging buffer per socket thread, ``STAGE_BYTES``
at a time, never a whole layer.
"""

from __future__ import annotations

import socket

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

    def send(self, sock: socket.socket, offset: int, nbytes: int, header: bytes = b"") -> None:
        """Send header then nbytes of the region from offset (cpu: one sendmsg for both)."""
        if self._view is not None:
            payload = self._view[offset:offset + nbytes]
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

    def recv(self, sock: socket.socket, offset: int, nbytes: int, stop=None, scratch: memoryview | None = None) -> bool:
        """Receive nbytes into the region at offset, PIECE_BYTES at a time.

        Before each piece ``stop()`` is asked; once it says True (the entry was deleted or
        failed meanwhile) the rest of the payload is read into ``scratch`` and dropped, so
        at most one piece lands in blocks the engine may already be reusing. Returns
        whether every byte landed.
        """
        done = 0
        while done < nbytes:
            if stop is not None and stop():
                discard(sock, nbytes - done, scratch)
                return False
            if self._view is not None:
                n = min(PIECE_BYTES, nbytes - done)
                recv_exact_into(sock, self._view[offset + done:offset + done + n])
            else:
                n = min(STAGE_BYTES, nbytes - done)
                recv_exact_into(sock, self._stage_view[:n])
                self._dev[offset + done:offset + done + n].copy_(self._stage[:n])
            done += n
        return True
