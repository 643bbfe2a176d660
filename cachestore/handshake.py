"""The compatibility check between a sender and a receiver, at bind time and on each connection.

Contract: two peers exchange KV only if they speak the same ``WIRE_VERSION`` and have
the same compatibility hash (dtype, layers, KV heads, head dim, block size). A mismatch is
refused with both sides' values in the message, never by corrupting memory:

* ``check_endpoint`` — the sender, before connecting, against the receiver's endpoint bytes
  (``CompatError``), and the transport must match (``ValueError``);
* ``client_hello`` / ``serve_hello`` — the first frames of every TCP connection: the sender
  sends HELLO {version, compat_hash, compat, agent, checksum}, the receiver answers HELLO_OK or
  ERROR. A receiver that requires KV checksums refuses a sender that sends none.
"""

from __future__ import annotations

import json
import socket

from .endpoint import Endpoint
from .errors import CompatError, ProtocolError, TransferError
from .frames import WIRE_VERSION, FrameType, encode_control, encode_json, read_frame_header, read_payload
from .memory import CompatInfo


def check_endpoint(ep: Endpoint, compat: CompatInfo, transport: str) -> None:
    """Sender side, at bind: CompatError (both values) or ValueError (transport) on a mismatch."""
    if ep.version != WIRE_VERSION or ep.compat_hash != compat.compat_hash:
        raise CompatError(
            f"incompatible peers: receiver {ep.host}:{ep.port} speaks protocol {ep.version} with compat hash "
            f"{ep.compat_hash} ({ep.compat}), this sender speaks protocol {WIRE_VERSION} with compat hash "
            f"{compat.compat_hash} ({compat.describe()})")
    if ep.transport != transport:
        raise ValueError(f"receiver {ep.host}:{ep.port} uses transport {ep.transport!r}, this sender {transport!r}")


def client_hello(sock: socket.socket, compat: CompatInfo, agent: str, peer: str, checksum: bool = False) -> None:
    """Sender side: HELLO, then HELLO_OK or raise (CompatError when the receiver refused)."""
    sock.sendall(encode_json(FrameType.HELLO, {"version": WIRE_VERSION, "compat_hash": compat.compat_hash,
                                               "compat": compat.describe(), "agent": agent, "checksum": checksum}))
    frame = read_frame_header(sock)
    if frame is None:
        raise TransferError(f"receiver {peer} closed the connection during the handshake")
    text = read_payload(sock, frame).decode(errors="replace")
    if frame.type == FrameType.ERROR:
        raise CompatError(f"receiver {peer} refused the handshake: {text}")
    if frame.type != FrameType.HELLO_OK:
        raise ProtocolError(f"expected HELLO_OK from {peer}, got {frame.type.name}")


def serve_hello(sock: socket.socket, compat: CompatInfo, require_checksum: bool = False,
                on_refuse=lambda reason: None) -> tuple[str | None, str]:
    """Receiver side: read HELLO and answer it. Returns (the sender's NIXL agent name, "") when
    accepted, (None, reason) when refused (``on_refuse(reason)`` ran, then ERROR was sent: a
    sender that sees the refusal also sees it counted) and (None, "") when the peer closed
    first; ProtocolError for a first frame that is not a HELLO."""
    frame = read_frame_header(sock)
    if frame is None:
        return None, ""
    if frame.type != FrameType.HELLO:
        raise ProtocolError(f"first frame must be HELLO, got {frame.type.name}")
    try:
        hello = json.loads(read_payload(sock, frame))
        version, their_hash = int(hello["version"]), str(hello["compat_hash"])
    except (ValueError, KeyError, TypeError):
        raise ProtocolError("HELLO payload is not the expected JSON") from None
    if version != WIRE_VERSION or their_hash != compat.compat_hash:
        text = (f"incompatible peers: receiver speaks protocol {WIRE_VERSION} with compat hash "
                f"{compat.compat_hash} ({compat.describe()}), sender speaks protocol {version} with "
                f"compat hash {their_hash} ({hello.get('compat', '?')})")
        on_refuse(text)
        sock.sendall(encode_control(FrameType.ERROR, "", text.encode()))
        return None, text
    if require_checksum and hello.get("checksum") is not True:
        text = ("this receiver requires KV checksums (--kv-checksum) and the sender sends none: "
                "turn checksums on at the sender (prefill --kv-checksum) or off at the receiver")
        on_refuse(text)
        sock.sendall(encode_control(FrameType.ERROR, "", text.encode()))
        return None, text
    sock.sendall(encode_control(FrameType.HELLO_OK, "", b"{}"))
    return str(hello.get("agent", "")), ""
