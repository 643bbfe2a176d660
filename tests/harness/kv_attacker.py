"""A stranger at a decode's KV port (issue 49's attacker tests): it speaks the CacheStore's frames over
plain TCP or over TLS with whatever certificate it holds, learns the receiver's compatibility hash
the way any peer can (from the refusal of a HELLO with a wrong one) and tries to bind and write KV
for a request id it learned, with a token it guessed.

    compat = learn_compat(port, ctx)      # CompatRefused... or the receiver's CompatInfo
    sock = hello(port, compat, ctx)       # past the TLS handshake and HELLO (or Refused)
    replies = push(sock, rid, compat)     # BIND + one DATA frame with a guessed token: the receiver's answers
"""

from __future__ import annotations

import re
import socket
import ssl

from pdserve.cachestore import CompatInfo
from pdserve.cachestore.frames import (WIRE_VERSION, FrameType, encode_control, encode_header, encode_json,
                                      read_frame_header, read_payload)
from pdserve.tls import SERVER_NAME

TIMEOUT_S = 10.0  # a hang guard on every read: the receiver answers in milliseconds
GUESSED_TOKEN = b"\x00" * 16


class Refused(Exception):
    """The receiver would not talk to us: at the TLS handshake, or at HELLO; the reason in words."""


def client_context(cert: str | None, key: str | None, ca: str) -> ssl.SSLContext:
    """What a stranger's TLS client looks like: it trusts the receiver's CA (it wants in), shows ``cert``
    (None: no certificate at all)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cafile=ca)
    if cert is not None:
        ctx.load_cert_chain(cert, key)
    return ctx


def _connect(port: int, ctx: ssl.SSLContext | None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)
    if ctx is None:
        return sock
    try:
        return ctx.wrap_socket(sock, server_hostname=SERVER_NAME)
    except (ssl.SSLError, OSError) as exc:
        sock.close()
        raise Refused(f"TLS handshake: {exc}") from None


def _send(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except (ssl.SSLError, OSError) as exc:  # TLS 1.3: the server's verdict on our certificate comes now
        raise Refused(f"{type(exc).__name__}: {exc}") from None


def _reply(sock: socket.socket) -> tuple[FrameType, str, str]:
    """(type, request id, text) of the receiver's next frame; Refused when it closed or reset instead."""
    try:
        frame = read_frame_header(sock)
        if frame is None:
            raise Refused("the receiver closed the connection")
        return frame.type, frame.rid, read_payload(sock, frame).decode(errors="replace")
    except (ssl.SSLError, OSError) as exc:
        raise Refused(f"{type(exc).__name__}: {exc}") from None


def learn_compat(port: int, ctx: ssl.SSLContext | None) -> CompatInfo:
    """The receiver's CompatInfo, read from its refusal of a HELLO with a wrong hash (Refused before that)."""
    sock = _connect(port, ctx)
    try:
        _send(sock, encode_json(FrameType.HELLO, {"version": WIRE_VERSION, "compat_hash": "0" * 16}))
        ftype, _, text = _reply(sock)
    finally:
        sock.close()
    m = re.search(r"receiver speaks protocol \d+ with compat hash \w+ \(dtype=(\w+) layers=(\d+) kv_heads=(\d+) "
                  r"head_dim=(\d+) block_size=(\d+)\)", text)
    if ftype != FrameType.ERROR or m is None:
        raise AssertionError(f"expected a HELLO refusal naming the receiver's compat, got {ftype.name}: {text}")
    dtype, *numbers = m.groups()
    return CompatInfo(dtype, *(int(n) for n in numbers))


def hello(port: int, compat: CompatInfo, ctx: ssl.SSLContext | None) -> socket.socket:
    """A connection past the handshake and HELLO (Refused otherwise)."""
    sock = _connect(port, ctx)
    try:
        _send(sock, encode_json(FrameType.HELLO, {"version": WIRE_VERSION, "compat_hash": compat.compat_hash,
                                                  "checksum": True}))  # it promises whatever is asked
        ftype, _, text = _reply(sock)
    except (Refused, OSError):
        sock.close()
        raise
    if ftype != FrameType.HELLO_OK:
        sock.close()
        raise Refused(f"HELLO answered with {ftype.name}: {text}")
    return sock


def push(sock: socket.socket, rid: str, compat: CompatInfo, token: bytes = GUESSED_TOKEN,
         block: int = 0) -> list[tuple[FrameType, str, str]]:
    """BIND rid and one DATA frame of one block of bytes 0xEE for its layer 0, with ``token``; the
    receiver's two answers."""
    _send(sock, encode_control(FrameType.BIND, rid, token=token))
    replies = [_reply(sock)]
    payload = b"\xee" * compat.block_nbytes
    _send(sock, encode_header(FrameType.DATA, rid, 0, block, 1, len(payload), token=token) + payload)
    replies.append(_reply(sock))
    return replies
