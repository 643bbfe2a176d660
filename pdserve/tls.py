"""Mutual TLS between pdserve's own processes: the flags, the certificate files, and the contexts and
credentials built from them, re-read when the files change.

One place for the flags: ``add_arguments`` gives every server (prefill, decode, router, the KV pool's
gManager) and ``pdserve up`` ``--tls-cert``, ``--tls-key`` and ``--tls-ca``; ``from_args`` reads them
(all three or none; a missing or unusable file ends the process at start with one line naming it).
Without them every internal port stays plain, as before.

``TlsFiles`` is what the servers pass around:

1. gRPC servers: ``add_port(server, address, tls)``: ``grpc.dynamic_ssl_server_credentials`` whose
   fetcher re-reads the files when they changed, so each new connection gets the current
   certificate and CA while open streams keep their session; clients must show a certificate
   signed by the CA (``require_client_authentication``).
2. gRPC clients: ``aio_channel``/``channel(address, tls, options)``: our certificate and the CA, read
   when the channel is made; every server's certificate must carry ``SERVER_NAME``, which clients
   check (``grpc.ssl_target_name_override``): pods are reached by IP, certificates name the service.
   A channel keeps what it read, so the long-lived ones (the prefill's to each decode, the router's
   to each prefill) compare ``stamp()`` with the one they were made under and, when the files
   changed, make a new channel for new calls while the old one's open streams finish (closed with
   a grace): a rotation to a new CA reaches reconnections too, and drops no stream.
3. The CacheStore's sockets (``cachestore/tls_sockets.py``): ``server_context``/``client_context``,
   rebuilt at the next connection after a file changed (its size, time or inode: a Kubernetes
   Secret update swaps a symlink). Server contexts send no TLS 1.3 session tickets (a reader thread
   never has to write on a connection another thread writes to).

A file that changed but cannot be loaded (half written) leaves the last good certificate in use and
is logged once per change. Nothing here logs a key or reads one into a log line: errors name files.
"""

from __future__ import annotations

import argparse
import logging
import os
import ssl
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # grpc is imported where it is used: the operator renders these flags without it
    import grpc

log = logging.getLogger("pdserve.tls")
SERVER_NAME = "pdserve.internal"  # every certificate's DNS name (SAN); clients check it (docs/security.md)
HELP = ("mutual TLS on every internal connection (gRPC between the servers, the CacheStore's KV port): "
        "give all three or none (docs/security.md)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--tls-cert, --tls-key and --tls-ca, in a group of their own."""
    g = parser.add_argument_group("mutual TLS (docs/security.md)", HELP)
    g.add_argument("--tls-cert", default=None, metavar="PATH",
                   help=f"this process's certificate (PEM, with its chain); its SAN names {SERVER_NAME}")
    g.add_argument("--tls-key", default=None, metavar="PATH", help="the certificate's private key (PEM)")
    g.add_argument("--tls-ca", default=None, metavar="PATH",
                   help="the CA certificate(s) (PEM) a peer's certificate must be signed by")


def from_args(args: argparse.Namespace, prog: str) -> TlsFiles | None:
    """The files of --tls-cert/--tls-key/--tls-ca (loaded once to check them), or None when none is
    given; ``SystemExit`` with one line naming the problem otherwise."""
    given = {flag: getattr(args, flag.lstrip("-").replace("-", "_"), None)
             for flag in ("--tls-cert", "--tls-key", "--tls-ca")}
    if not any(given.values()):
        return None
    missing = [flag for flag, value in given.items() if not value]
    if missing:
        raise SystemExit(f"{prog}: mutual TLS needs --tls-cert, --tls-key and --tls-ca; missing {', '.join(missing)}")
    files = TlsFiles(given["--tls-cert"], given["--tls-key"], given["--tls-ca"])
    try:
        files.check()
    except TlsFileError as exc:
        raise SystemExit(f"{prog}: {exc}") from None
    return files


def flags(tls: TlsFiles | None) -> list[str]:
    """The command-line flags that hand ``tls`` on to a server process (none without TLS)."""
    if tls is None:
        return []
    return ["--tls-cert", tls.cert, "--tls-key", tls.key, "--tls-ca", tls.ca]


class TlsFileError(ValueError):
    """A certificate, key or CA file that cannot be read or used; the message names the file, never its content."""


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TlsFileError(f"{what} {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN" not in data:
        raise TlsFileError(f"{what} {path}: not a PEM file")
    return data


@dataclass(slots=True)
class _Loaded:
    """One reading of the three files (their stamps, their bytes) and what was built from it."""

    stamp: tuple
    cert: bytes
    key: bytes
    ca: bytes
    server: ssl.SSLContext
    client: ssl.SSLContext


@dataclass
class TlsFiles:
    """The certificate, key and CA files of this process; contexts follow the files (module docstring)."""

    cert: str
    key: str
    ca: str
    server_name: str = SERVER_NAME
    _loaded: _Loaded | None = field(default=None, init=False, repr=False)
    _bad_stamp: tuple | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        self.cert, self.key, self.ca = (os.path.abspath(p) for p in (self.cert, self.key, self.ca))

    # ----- reading the files -------------------------------------------------------------
    def _stamp(self) -> tuple:
        out = []
        for path in (self.cert, self.key, self.ca):
            try:
                st = os.stat(path)
                out.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                out.append(None)
        return tuple(out)

    def _load(self, stamp: tuple) -> _Loaded:
        cert, key, ca = _read(self.cert, "--tls-cert"), _read(self.key, "--tls-key"), _read(self.ca, "--tls-ca")
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # checks the server's name and certificate
        for ctx in (server, client):
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            try:
                ctx.load_cert_chain(self.cert, self.key)
            except ssl.SSLError as exc:
                raise TlsFileError(f"--tls-cert {self.cert} / --tls-key {self.key}: cannot be used together "
                                   f"({exc.reason or exc})") from None
            try:
                ctx.load_verify_locations(cafile=self.ca)
            except ssl.SSLError as exc:
                raise TlsFileError(f"--tls-ca {self.ca}: not a CA certificate ({exc.reason or exc})") from None
            ctx.verify_mode = ssl.CERT_REQUIRED
        server.num_tickets = 0
        return _Loaded(stamp, cert, key, ca, server, client)

    def check(self) -> None:
        """Load the files now (TlsFileError naming the file at fault)."""
        with self._lock:
            stamp = self._stamp()
            self._loaded = self._load(stamp)

    def current(self) -> _Loaded:
        """The files as of now: re-read when they changed since the last reading; when they changed
        but cannot be used (yet), the last good reading (logged once per change)."""
        stamp = self._stamp()
        with self._lock:
            loaded = self._loaded
            if loaded is not None and (stamp == loaded.stamp or stamp == self._bad_stamp):
                return loaded
            try:
                self._loaded = self._load(stamp)
            except TlsFileError as exc:
                if loaded is None:
                    raise
                self._bad_stamp = stamp
                log.warning("TLS files changed but cannot be used, keeping the previous certificate: %s", exc)
                return loaded
            if loaded is not None:
                log.info("TLS files changed: new connections use the new certificate (%s)", self.cert)
            return self._loaded

    def stamp(self) -> tuple:
        """Which reading of the files is current (changes when a rotation has been loaded)."""
        return self.current().stamp

    # ----- the CacheStore's sockets (cachestore.TlsContexts) -------------------------------
    def server_context(self) -> ssl.SSLContext:
        return self.current().server

    def client_context(self) -> ssl.SSLContext:
        return self.current().client

    # ----- gRPC ------------------------------------------------------------------------
    def _server_config(self, loaded: _Loaded):
        import grpc

        return grpc.ssl_server_certificate_configuration([(loaded.key, loaded.cert)], root_certificates=loaded.ca)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials for a gRPC server: clients must show a certificate of the CA; re-read on change."""
        import grpc

        first = self.current()
        seen = [first.stamp]

        def fetch():  # called by gRPC for each new connection: None keeps the current configuration
            loaded = self.current()
            if loaded.stamp == seen[0]:
                return None
            seen[0] = loaded.stamp
            return self._server_config(loaded)

        return grpc.dynamic_ssl_server_credentials(self._server_config(first), fetch,
                                                   require_client_authentication=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        import grpc

        loaded = self.current()
        return grpc.ssl_channel_credentials(root_certificates=loaded.ca, private_key=loaded.key,
                                            certificate_chain=loaded.cert)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)]


def add_port(server, address: str, tls: TlsFiles | None) -> int:
    """Listen on ``address`` (a grpc or grpc.aio server): mutual TLS with ``tls``, plain without. Returns the port."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())


def _make(address: str, tls: TlsFiles | None, options, insecure: Callable, secure: Callable):
    opts = list(options or [])
    if tls is None:
        return insecure(address, options=opts)
    return secure(address, tls.channel_credentials(), options=opts + tls.channel_options())


def aio_channel(address: str, tls: TlsFiles | None, options=None) -> grpc.aio.Channel:
    """A grpc.aio channel to ``address``: mutual TLS with ``tls``, plain without."""
    import grpc

    return _make(address, tls, options, grpc.aio.insecure_channel, grpc.aio.secure_channel)


def channel(address: str, tls: TlsFiles | None, options=None) -> grpc.Channel:
    """A (synchronous) grpc channel to ``address``: mutual TLS with ``tls``, plain without."""
    import grpc

    return _make(address, tls, options, grpc.insecure_channel, grpc.secure_channel)
