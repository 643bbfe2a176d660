"""The wire format of the CacheStore control/data connection (one TCP stream per connection).

Every frame is a fixed header, then the request id (UTF-8), then ``payload_len`` bytes:

    magic    4s   b"PDKV"
    version  u16  WIRE_VERSION
    type     u8   HELLO | HELLO_OK | BIND | DATA | ACK | CANCEL | ERROR | WRITTEN
    flags    u8   DATA: FLAG_CRC32C (the crc field is set); ERROR: FLAG_CHECKSUM_MISMATCH; else 0
    rid_len  u16  length of the request id that follows (0 for connection-level frames)
    layer    u32  DATA/ACK: the layer
    block    u64  DATA/ACK: first destination block id
    nblocks  u32  DATA/ACK: number of contiguous destination blocks
    payload  u64  length of the payload after the request id
    crc      u32  DATA with FLAG_CRC32C: CRC32C of the payload (``checksum.py``); else 0
    token    16s  BIND and DATA: the bind token the receiver issued for the request (``expect``); else zeros

DATA payloads are exactly ``nblocks * block_nbytes`` bytes of KV, received straight into the
destination blocks; the receiver checks the crc before it ACKs (and before the blocks count
as arrived). HELLO/HELLO_OK/ERROR payloads are small JSON or UTF-8 texts. An ERROR for a
request with FLAG_CHECKSUM_MISMATCH says its KV arrived corrupted (the sender raises
``ChecksumError``).

Version 2 added the crc field and the flags (version 1 had a 34-byte header, flags always 0).
Version 3 added the token (a 54-byte header): a BIND or DATA frame whose token is not the one the
receiver issued for that request is refused (``entries.py``), so only the prefill that got the
decode's Allocation on its Session can push KV for the request.
"""

from __future__ import annotations

import enum
import json
import socket
import struct
import time
from dataclasses import dataclass
from typing import Callable

from .errors import ProtocolError
from .tls_sockets import WOULD_BLOCK, recv_flags

MAGIC = b"PDKV"
# the CacheStore's own wire format (frames and HELLO); not the Session protocol (protos/version.py: PROTOCOL_VERSION)
WIRE_VERSION = 3  # 2: DATA frames carry a CRC32C, NIXL notifications one per slice; 3: bind tokens
HEADER = struct.Struct("!4sHBBHIQIQI16s")
TOKEN_BYTES = 16  # a request's bind token (entries.py), in BIND/DATA headers and NIXL notifications
FLAG_CRC32C = 0x01             # DATA: the crc field holds the payload's CRC32C
FLAG_CHECKSUM_MISMATCH = 0x01  # ERROR: the request's KV failed its checksum on the receiver
MAX_RID_LEN = 1024
MAX_CONTROL_PAYLOAD = 1 << 20  # any non-DATA payload above this is garbage


class FrameType(enum.IntEnum):
    HELLO = 1     # sender -> receiver: {"version", "compat_hash", "compat", "sender"}
    HELLO_OK = 2  # receiver -> sender: handshake accepted
    BIND = 3      # sender -> receiver: this connection carries request rid from now on
    DATA = 4      # sender -> receiver: KV bytes for (rid, layer, block..block+nblocks)
    ACK = 5       # receiver -> sender: those bytes landed (same rid/layer/block/nblocks)
    CANCEL = 6    # sender -> receiver: the sender gave up on rid
    ERROR = 7     # either way: UTF-8 reason; with a rid it fails that request, without it the connection
    WRITTEN = 8   # sender -> receiver (same node): KV already copied into the shared region; payload: records
                  # as a NIXL notification's (samenode_receive.py), answered with an ACK per slice


@dataclass(slots=True)
class Frame:
    type: FrameType
    rid: str = ""
    layer: int = 0
    block: int = 0
    nblocks: int = 0
    payload_len: int = 0
    flags: int = 0
    crc: int = 0
    token: bytes = bytes(TOKEN_BYTES)


def encode_header(ftype: FrameType, rid: str = "", layer: int = 0, block: int = 0, nblocks: int = 0,
                  payload_len: int = 0, flags: int = 0, crc: int = 0, token: bytes = b"") -> bytes:
    """Header + request id bytes (the payload is sent after it, from wherever it lives)."""
    rid_b = rid.encode()
    if len(rid_b) > MAX_RID_LEN:
        raise ValueError(f"request id longer than {MAX_RID_LEN} bytes: {rid[:40]!r}...")
    if len(token) not in (0, TOKEN_BYTES):
        raise ValueError(f"a bind token is {TOKEN_BYTES} bytes, got {len(token)}")
    return HEADER.pack(MAGIC, WIRE_VERSION, int(ftype), flags, len(rid_b), layer, block, nblocks, payload_len,
                       crc, token) + rid_b


def encode_control(ftype: FrameType, rid: str = "", payload: bytes = b"", **fields) -> bytes:
    """A whole small frame (header, rid and payload) as one bytes object."""
    return encode_header(ftype, rid, payload_len=len(payload), **fields) + payload


def encode_json(ftype: FrameType, obj: dict, rid: str = "") -> bytes:
    return encode_control(ftype, rid, json.dumps(obj, sort_keys=True).encode())


OnWait = Callable[[float], None]


def _recv_into(sock: socket.socket, view: memoryview, n: int, on_wait: OnWait | None, since: float) -> int:
    """One recv_into(MSG_WAITALL). On a socket with ``SO_RCVTIMEO`` (the receiver's connections)
    a receive that got no byte within it raises EAGAIN (a TLS socket: SSLWantReadError): with
    ``on_wait`` given, it is called with the seconds since ``since`` (the last byte) and may raise
    to give up; then it retries. TLS sockets take no MSG_WAITALL (``tls_sockets.recv_flags``)."""
    while True:
        try:
            return sock.recv_into(view, n, recv_flags(sock))
        except WOULD_BLOCK:
            if on_wait is None:
                raise
            on_wait(time.monotonic() - since)


def recv_exact_into(sock: socket.socket, view: memoryview, on_wait: OnWait | None = None) -> None:
    """Fill view completely from sock (blocking); ProtocolError if the peer closes first.

    ``on_wait(stalled_s)``: see ``_recv_into`` (called while no byte arrives, may raise)."""
    got = 0
    total = len(view)
    last = time.monotonic() if on_wait is not None else 0.0
    while got < total:
        n = _recv_into(sock, view[got:], total - got, on_wait, last)
        if n == 0:
            raise ProtocolError(f"connection closed mid-frame ({got} of {total} bytes received)")
        got += n
        if on_wait is not None and got < total:
            last = time.monotonic()


def recv_exact(sock: socket.socket, n: int, on_wait: OnWait | None = None) -> bytes:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf), on_wait)
    return bytes(buf)


def read_frame_header(sock: socket.socket, on_wait: OnWait | None = None) -> Frame | None:
    """Read and validate one header + request id. None on a clean close between frames.

    ``on_wait``: see ``_recv_into``; also called while the connection is idle between frames."""
    buf = bytearray(HEADER.size)
    view = memoryview(buf)
    first = _recv_into(sock, view, HEADER.size, on_wait, time.monotonic() if on_wait is not None else 0.0)
    if first == 0:
        return None
    if first < HEADER.size:
        recv_exact_into(sock, view[first:], on_wait)
    magic, version, ftype, flags, rid_len, layer, block, nblocks, payload_len, crc, token = HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r}): not a pdserve CacheStore "
                            f"peer or a corrupted stream")
    if version != WIRE_VERSION:
        raise ProtocolError(f"frame protocol version {version}, this side speaks {WIRE_VERSION}")
    try:
        ftype = FrameType(ftype)
    except ValueError:
        raise ProtocolError(f"unknown frame type {ftype}") from None
    if rid_len > MAX_RID_LEN:
        raise ProtocolError(f"request id length {rid_len} exceeds {MAX_RID_LEN}")
    if ftype != FrameType.DATA and payload_len > MAX_CONTROL_PAYLOAD:
        raise ProtocolError(f"{ftype.name} frame payload of {payload_len} bytes exceeds {MAX_CONTROL_PAYLOAD}")
    rid = ""
    if rid_len:
        try:
            rid = recv_exact(sock, rid_len, on_wait).decode()
        except UnicodeDecodeError:
            raise ProtocolError("request id is not valid UTF-8") from None
    return Frame(ftype, rid, layer, block, nblocks, payload_len, flags, crc, token)


def read_payload(sock: socket.socket, frame: Frame, on_wait: OnWait | None = None) -> bytes:
    return recv_exact(sock, frame.payload_len, on_wait)


def discard(sock: socket.socket, nbytes: int, scratch: memoryview, on_wait: OnWait | None = None) -> None:
    """Read and drop nbytes (payload of a rejected DATA frame) so the stream stays in sync."""
    while nbytes > 0:
        n = min(nbytes, len(scratch))
        recv_exact_into(sock, scratch[:n], on_wait)
        nbytes -= n
