"""Mutual TLS on the CacheStore's TCP connections: what changes on a socket when it is on.

Contract: with ``tls`` given (a ``TlsContexts``, built by the servers from ``--tls-cert/--tls-key/
--tls-ca``: ``pdserve/tls.py``), every connection the receiver accepts and every connection a
sender's link opens does a TLS handshake first, before HELLO, on the same socket; both sides show a
certificate and both check the other's against the CA (the receiver's also carries the name
``server_name`` that senders check). A peer that fails the handshake (no certificate, one of another
CA, expired) never reaches HELLO: the receiver counts it in ``tls_refused`` (and
``connections_refused``) and logs the first refusal from each peer host once (``TlsRefusals``); the
sender's link fails with a ``TransferError`` naming the receiver and why.

Contexts are asked for at each new connection, so certificate files replaced on disk are used by
the next connection while the open ones keep their session (``pdserve/tls.py`` reloads on change).
Without ``tls`` nothing here runs: the sockets stay plain (the default, and today's tests).

An ``ssl.SSLSocket`` differs from a plain one in three ways the frame code meets: ``recv_into``
takes no flags (no MSG_WAITALL: ``recv_flags``), there is no ``sendmsg`` (``send_two``), and a
receive or send that ``SO_RCVTIMEO``/``SO_SNDTIMEO`` cut short raises ``SSLWantReadError`` /
``SSLWantWriteError`` instead of ``BlockingIOError`` (``WOULD_BLOCK``). One thread reads and another
writes each connection (as on plain sockets); servers' contexts send no TLS 1.3 session tickets, so
a read never has to write (``pdserve/tls.py``).

NIXL's data path is outside this: WRITEs go by UCX (RDMA on a cluster), unencrypted; what a sender
needs to reach the receiver's memory (agent metadata, region descriptor) travels only in the
endpoint bytes over the Session's gRPC stream (mutual TLS too) and its agent name in HELLO.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from typing import Protocol

from .errors import TransferError

log = logging.getLogger("pdserve.cachestore.tls")
HANDSHAKE_TIMEOUT_S = 5.0  # a peer that does not finish its TLS handshake within this is dropped
WOULD_BLOCK = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


class TlsContexts(Protocol):
    """The current server and client contexts (re-read from their files when those change)."""

    server_name: str  # the name the receivers' certificates carry; senders check it

    def server_context(self) -> ssl.SSLContext:
        """For an accepted connection: shows our certificate, requires the peer's (CERT_REQUIRED)."""

    def client_context(self) -> ssl.SSLContext:
        """For a connection we open: shows our certificate, checks the peer's and its name."""


def recv_flags(sock: socket.socket) -> int:
    """The flags for ``recv_into``: MSG_WAITALL on a plain socket, none on a TLS one (it takes none)."""
    return 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL


def send_two(sock: socket.socket, header: bytes, body: memoryview) -> None:
    """Send header then body: one ``sendmsg`` on a plain socket, two writes on a TLS one."""
    if isinstance(sock, ssl.SSLSocket):
        sock.sendall(header)
        sock.sendall(body)
        return
    sent = sock.sendmsg([header, body])
    if sent < len(header):
        sock.sendall(header[sent:])
        sent = len(header)
    if sent - len(header) < len(body):
        sock.sendall(body[sent - len(header):])


def _reason(exc: BaseException) -> str:
    """What went wrong in a handshake, in words (OpenSSL's reason, never key material)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate not accepted: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    return str(exc) or type(exc).__name__


def wrap_client(sock: socket.socket, tls: TlsContexts, peer: str, timeout_s: float) -> ssl.SSLSocket:
    """A sender's connection to ``peer``, after the TLS handshake (TransferError naming peer and why)."""
    sock.settimeout(timeout_s)
    try:
        return tls.client_context().wrap_socket(sock, server_hostname=tls.server_name)
    except (ssl.SSLError, OSError) as exc:
        sock.close()
        raise TransferError(f"TLS handshake with CacheStore receiver {peer} failed: {_reason(exc)}") from None


class TlsRefusals:
    """The receiver's side: wraps accepted sockets, counts the peers refused, logs each host once."""

    def __init__(self, tls: TlsContexts, counters: dict):
        self.tls, self.counters = tls, counters
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def accept(self, sock: socket.socket, peer: str) -> ssl.SSLSocket | None:
        """The accepted connection after the TLS handshake, or None (refused: counted, logged once a host)."""
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            wrapped = self.tls.server_context().wrap_socket(sock, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            self._refused(peer, _reason(exc))
            sock.close()
            return None
        wrapped.settimeout(None)
        return wrapped

    def _refused(self, peer: str, reason: str) -> None:
        host = peer.rsplit(":", 1)[0]
        with self._lock:
            self.counters["tls_refused"] += 1
            self.counters["connections_refused"] += 1
            first = host not in self._logged
            self._logged.add(host)
        if first:
            log.warning("CacheStore refused a connection from %s at the TLS handshake: %s (later refusals from this "
                        "host are counted in tls_refused, not logged)", peer, reason)
