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
from typing import TYPE_CHECKING

from .checksum import crc32c
from .frames import discard, recv_exact_into
from .memory import MemoryRegion
from .tls_sockets import send_two

if TYPE_CHECKING:
    import torch

STAGE_BYTES = 4 << 20
PIECE_BYTES = 1 << 20  # receive granularity: a deleted entry stops receiving within one piece


class RegionIO:
    """Per-thread helper bound to one region (holds that thread's staging buffer for cuda)."""

    def __init__(self, region: MemoryRegion):
        self.region = region
        self._view = region.host_view() if region.device == "cpu" else None
        self._staging: tuple[torch.Tensor, torch.Tensor, memoryview] | None = None  # cuda
        if region.device == "cuda":
            import torch

            stage = torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=True)
            self._staging = (region.owner.reshape(-1).view(torch.uint8), stage, stage.numpy().data.cast("B"))

    def _staged(self) -> tuple[torch.Tensor, torch.Tensor, memoryview]:
        """A cuda region's bytes on the device, this thread's pinned staging buffer and a view of it."""
        if self._staging is None:
            raise ValueError(f"a {self.region.device} region has no staging buffer (only cuda regions are staged)")
        return self._staging

    def crc(self, offset: int, nbytes: int) -> int:
        """CRC32C of nbytes of the region from offset."""
        if self._view is not None:
            return crc32c(self._view[offset:offset + nbytes])
        dev, stage, stage_view = self._staged()
        value, done = 0, 0
        while done < nbytes:
            n = min(STAGE_BYTES, nbytes - done)
            stage[:n].copy_(dev[offset + done:offset + done + n])
            value = crc32c(stage_view[:n], value)
            done += n
        return value

    def copy_out(self, offset: int, nbytes: int) -> bytearray:
        """A host copy of nbytes of the region from offset (the corruption test hook sends one)."""
        if self._view is not None:
            return bytearray(self._view[offset:offset + nbytes])
        return bytearray(self._staged()[0][offset:offset + nbytes].cpu().numpy().tobytes())

    def send(self, sock: socket.socket, offset: int, nbytes: int, header: bytes = b"", payload=None) -> None:
        """Send header then nbytes of the region from offset (cpu: one sendmsg for both; TLS: two writes).

        ``payload`` (bytes-like, nbytes long) is sent instead of the region's bytes when given
        (the corruption test hook)."""
        host = memoryview(payload) if payload is not None else (
            self._view[offset:offset + nbytes] if self._view is not None else None)
        if host is not None:
            send_two(sock, header, host)
            return
        if header:
            sock.sendall(header)
        dev, stage, stage_view = self._staged()
        done = 0
        while done < nbytes:
            n = min(STAGE_BYTES, nbytes - done)
            stage[:n].copy_(dev[offset + done:offset + done + n])
            sock.sendall(stage_view[:n])
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
                discard(sock, nbytes - done, scratch if scratch is not None else memoryview(bytearray(PIECE_BYTES)),
                        on_wait)
                return False, 0
            if self._view is not None:
                n = min(PIECE_BYTES, nbytes - done)
                piece = self._view[offset + done:offset + done + n]
                recv_exact_into(sock, piece, on_wait)
            else:
                dev, stage, stage_view = self._staged()
                n = min(STAGE_BYTES, nbytes - done)
                piece = stage_view[:n]
                recv_exact_into(sock, piece, on_wait)
                dev[offset + done:offset + done + n].copy_(stage[:n])
            if checksum:
                value = crc32c(piece, value)
            done += n
        return True, value
