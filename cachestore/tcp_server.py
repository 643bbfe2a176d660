"""The receiver's TCP side: accept sender connections and serve each on its own thread.

Contract: with ``tls`` every accepted connection first does a mutual TLS handshake
(``tls_sockets.py``: refused peers are counted and logged once a host); then every connection
passes the handshake (``handshake.serve_hello``), then carries BIND, DATA (tcp transport), CANCEL
and ERROR frames. A BIND or DATA frame must carry the request's bind token (``entries.py``): with
another token it is refused (a DATA frame's bytes read and dropped), answered with ERROR rid, and
the entry is untouched; a CANCEL or ERROR for a request counts only from the connection that bound
it. A DATA frame is checked against the ``EntryTable`` before a byte is written (unknown request,
wrong token or blocks not allocated to it: read and dropped, answered with ERROR rid); its bytes
land straight in the region, 1 MiB at a time, stopping when the entry is deleted or failed meanwhile; a frame that carries
a CRC32C is summed as it lands and compared before anything else (a mismatch: the blocks do
not count as arrived, no ACK, the receiver fails the entry, ``checksum.py``); then ACK. A
malformed frame closes that connection with an ERROR naming the problem. When a connection
ends, the entries it bound that were not complete fail.

A sender that stops mid-frame (frozen: alive, connection open) must not leave a reader thread
inside a DATA frame of an entry the decode has given up on: once the sender connects,
receives on its connection time out every ``RECV_POLL_S`` (``SO_RCVTIMEO``, the thread just
retries), and when no byte of a DATA frame has arrived for ``stall_timeout_s`` while its
entry is deleted or failed, the connection is shut down and closed (``connections_cut``)
before the frame ends, so no later byte of it can land and ``released`` reports only then. The
sender's link fails on it and reconnects for later requests. An idle connection, or a frame
whose entry is still live (its own timeout fails it, then the rule above applies), waits. Everything the event loop must hear
goes through a ``ReceiveSink``; these threads touch only the lock-protected table.
"""  # noqa: E501

from __future__ import annotations

import itertools
import logging
import socket
import threading
from typing import Callable, Iterable, Protocol

from .checksum import mismatch_text
from .entries import EntryTable
from .errors import BindRefused, ChecksumError, ProtocolError, TransferError, UnknownRequestError
from .frames import (FLAG_CRC32C, Frame, FrameType, discard, encode_control, encode_header, read_frame_header,
                     read_payload)
from .handshake import serve_hello
from .memory import CompatInfo, KVLayout, MemoryRegion
from .tls_sockets import TlsContexts, TlsRefusals
from .wire_io import RegionIO

log = logging.getLogger("pdserve.cachestore.receiver")
SEND_TIMEOUT_S = 5.0  # a sender that stops reading ACK/ERROR frames for this long is dropped
RECV_POLL_S = 0.25    # receives wake up this often to check whether a stalled frame must be cut


class FrameStalled(OSError):
    """A DATA frame for a deleted/failed entry got no byte for the stall bound: the connection is cut."""


def _keep_waiting(stalled_s: float) -> None:
    """on_wait for reads that write nothing into the region (idle, headers, control frames)."""


def _timeval(seconds: float) -> bytes:
    return int(seconds).to_bytes(8, "little") + int((seconds - int(seconds)) * 1e6).to_bytes(8, "little")


class ReceiveSink(Protocol):
    """What the socket threads report to the receiver (called from those threads)."""

    def on_arrived(self, rids: Iterable[str]) -> None:
        """These requests completed a layer, or failed: wake their waiters."""

    def on_fail(self, rid: str, err: TransferError) -> None:
        """Fail rid (the sender already knows: it gave up, or it was answered with ERROR)."""

    def on_frame_end(self, rid: str) -> None:
        """A frame stopped writing into rid's blocks (for ``released`` waiters)."""

    def on_corrupt(self, err: ChecksumError) -> None:
        """A slice of err.request_id's KV failed its checksum (nothing of it counted as arrived): fail
        the entry and tell the sender."""


class SenderConnection:
    """One accepted sender connection; send() may be called from any thread."""

    def __init__(self, cid: int, sock: socket.socket, peer: str):
        self.id = cid
        self.sock = sock
        self.peer = peer
        self.agent = ""  # the sender's NIXL agent name (from HELLO)
        self.refusals_logged = False  # a wrong bind token from this connection was logged (once)
        self._send_lock = threading.Lock()

    def send(self, data: bytes) -> bool:
        try:
            with self._send_lock:
                self.sock.sendall(data)
            return True
        except OSError:
            return False

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class TcpServer:
    """Listener, accept thread and one reader thread per sender connection."""

    def __init__(self, region: MemoryRegion, layout: KVLayout, compat: CompatInfo, frames_carry_data: bool,
                 table: EntryTable, counters: dict, sink: ReceiveSink, require_checksum: bool = False,
                 stall_timeout_s: float = 1.0, tls: TlsContexts | None = None):
        self.region, self.layout, self.compat = region, layout, compat
        self.tls = TlsRefusals(tls, counters) if tls is not None else None
        self.frames_carry_data = frames_carry_data  # tcp: DATA frames bring the bytes (transport.py)
        self.stall_timeout_s = stall_timeout_s
        self.require_checksum = require_checksum
        self.table, self.counters, self.sink = table, counters, sink
        self.port = 0
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._conns: dict[int, SenderConnection] = {}
        self._conns_lock = threading.Lock()
        self._conn_ids = itertools.count(1)
        self._stopping = False
        # WRITTEN frames (a same-node sender copied into the shared region): samenode_receive.SameNodeReceive.handle
        self.written: Callable[[SenderConnection, Frame, Callable], None] | None = None

    def listen(self, host: str, port: int) -> int:
        """Bind host:port (0 picks a free one), start accepting; returns the port."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        self._listener = sock
        self.port = sock.getsockname()[1]
        self._spawn(self._accept_loop, "cachestore-rx-accept")
        return self.port

    def close(self) -> list[threading.Thread]:
        """Stop accepting, close every connection; returns the threads to join."""
        self._stopping = True
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        with self._conns_lock:
            conns = list(self._conns.values())
        for conn in conns:
            conn.close()
        return list(self._threads)

    def connections(self) -> int:
        with self._conns_lock:
            return len(self._conns)

    def send_error(self, cid: int, rid: str, text: str, flags: int = 0) -> None:
        with self._conns_lock:
            conn = self._conns.get(cid)
        if conn is not None:
            conn.send(encode_header(FrameType.ERROR, rid, payload_len=len(text.encode()[:60000]), flags=flags)
                      + text.encode()[:60000])

    # ----- threads ---------------------------------------------------------------------
    def _spawn(self, target, name: str, *args) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def _accept_loop(self) -> None:
        listener = self._listener
        while not self._stopping and listener is not None:
            try:
                sock, addr = listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(SEND_TIMEOUT_S))
            conn = SenderConnection(next(self._conn_ids), sock, f"{addr[0]}:{addr[1]}")
            with self._conns_lock:
                self._conns[conn.id] = conn
            self._spawn(self._serve, f"cachestore-rx-conn{conn.id}", conn)

    def _refused(self, reason: str) -> None:
        self.counters["connections_refused"] += 1

    def _serve(self, conn: SenderConnection) -> None:
        reason = "sender connection closed before all KV arrived"
        try:
            if self.tls is not None:
                wrapped = self.tls.accept(conn.sock, conn.peer)
                if wrapped is None:
                    return
                conn.sock = wrapped
            agent, refused = serve_hello(conn.sock, self.compat, self.require_checksum, on_refuse=self._refused)
            if agent is None:
                if refused:
                    log.warning("refused %s: %s", conn.peer, refused)
                return
            conn.agent = agent
            # receives now wake up every RECV_POLL_S (the on_wait callbacks decide: retry or cut)
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(RECV_POLL_S))
            io = RegionIO(self.region) if self.frames_carry_data else None
            scratch = memoryview(bytearray(1 << 16))
            while True:
                frame = read_frame_header(conn.sock, _keep_waiting)
                if frame is None:
                    return
                if frame.type == FrameType.DATA and io is not None:
                    self._on_data(conn, frame, io, scratch)
                elif frame.type == FrameType.WRITTEN and self.written is not None:
                    self.written(conn, frame, _keep_waiting)
                elif frame.type == FrameType.BIND:
                    read_payload(conn.sock, frame, _keep_waiting)
                    try:
                        self.table.bind(frame.rid, conn.id, frame.token)
                    except UnknownRequestError as exc:
                        if isinstance(exc, BindRefused):
                            self._refused_token(conn, exc)
                        conn.send(encode_control(FrameType.ERROR, frame.rid, str(exc).encode()))
                elif frame.type in (FrameType.CANCEL, FrameType.ERROR):
                    text = read_payload(conn.sock, frame, _keep_waiting).decode(errors="replace")
                    if frame.rid and not self.table.bound_by(frame.rid, conn.id):
                        log.debug("ignored %s for request %r from %s, which did not bind it", frame.type.name,
                                  frame.rid, conn.peer)
                    elif frame.rid:
                        self.sink.on_fail(frame.rid,
                                          TransferError(f"request {frame.rid!r}: the sender gave up: {text}"))
                    else:
                        log.warning("sender %s reported: %s", conn.peer, text)
                else:
                    raise ProtocolError(f"unexpected {frame.type.name} frame from a sender")
        except ProtocolError as exc:
            reason = f"connection from {conn.peer} closed: {exc}"
            log.warning("CacheStore %s", reason)
            self.counters["frames_rejected"] += 1
            conn.send(encode_control(FrameType.ERROR, "", str(exc).encode()))
        except FrameStalled as exc:
            reason = f"sender connection {conn.peer} cut: {exc}"
            log.warning("CacheStore %s", reason)
        except OSError as exc:
            reason = f"sender connection {conn.peer} failed: {exc}"
        finally:
            with self._conns_lock:
                self._conns.pop(conn.id, None)
            conn.close()
            failed = self.table.fail_connection(conn.id, reason)
            if failed:
                self.sink.on_arrived([e.rid for e in failed])

    def _refused_token(self, conn: SenderConnection, exc: BindRefused) -> None:
        """A BIND or DATA frame with a wrong bind token: counted; logged once a connection."""
        self.counters["binds_refused"] += 1
        if not conn.refusals_logged:
            conn.refusals_logged = True
            log.warning("CacheStore connection from %s: %s (later refusals on this connection are counted in "
                        "binds_refused, not logged)", conn.peer, exc)

    def _on_data(self, conn: SenderConnection, f: Frame, io: RegionIO, scratch: memoryview) -> None:
        nbytes = f.nblocks * self.layout.block_nbytes
        if f.payload_len != nbytes or f.nblocks == 0 or f.block + f.nblocks > self.layout.num_blocks:
            raise ProtocolError(f"DATA frame for {f.rid!r}: {f.nblocks} blocks from block {f.block} with a payload of "
                                f"{f.payload_len} bytes does not fit blocks of {self.layout.block_nbytes} bytes")
        try:
            entry = self.table.begin_receive(f.rid, f.layer, f.block, f.nblocks, f.token)
        except (UnknownRequestError, ProtocolError) as exc:
            discard(conn.sock, f.payload_len, scratch, _keep_waiting)
            self.counters["frames_rejected"] += 1
            if isinstance(exc, BindRefused):
                self._refused_token(conn, exc)
            if isinstance(exc, ProtocolError):  # a known request writing outside its blocks: fail it
                self.sink.on_fail(f.rid, TransferError(str(exc)))
            if isinstance(getattr(exc, "cause", None), ChecksumError):
                return  # its ERROR (checksum mismatch, the root cause) is on its way: the sender learns that first
            conn.send(encode_control(FrameType.ERROR, f.rid, str(exc).encode()))
            return
        checksum = bool(f.flags & FLAG_CRC32C)
        ok, bad = False, None

        def on_wait(stalled_s: float) -> None:
            if (entry.deleted or entry.error is not None) and stalled_s >= self.stall_timeout_s:
                # shut the connection before the frame ends: no later byte of it can land
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                # counted and forgotten before the frame ends, which is what `released` waits for
                self.counters["connections_cut"] += 1
                with self._conns_lock:
                    self._conns.pop(conn.id, None)
                raise FrameStalled(f"DATA frame for request {f.rid!r} (layer {f.layer}, blocks {f.block}.."
                                   f"{f.block + f.nblocks - 1}) got no byte for {stalled_s:.1f}s after the request "
                                   "was deleted or failed (sender frozen?)")

        try:
            ok, got = io.recv(conn.sock, self.layout.offset(f.layer, f.block), nbytes,
                              stop=lambda: entry.deleted or entry.error is not None, scratch=scratch, checksum=checksum,
                              on_wait=on_wait)
            if ok and checksum and got != f.crc:
                bad = ChecksumError(mismatch_text(f.rid, f.layer, f.block, f.nblocks, f.crc, got), f.rid, f.layer)
        finally:
            touched = self.table.end_receive(f.rid, f.layer, f.block, f.nblocks, ok and bad is None)
            self.sink.on_arrived(touched)
            self.sink.on_frame_end(f.rid)
        if bad is not None:  # no ACK: the receiver fails the entry and sends ERROR (FLAG_CHECKSUM_MISMATCH)
            self.sink.on_corrupt(bad)
            return
        if not ok:  # the entry went away mid-frame; the sender has been told by delete/fail
            return
        if checksum:
            self.counters["frames_verified"] += 1
        self.counters["bytes_received"] += nbytes
        self.counters["frames_received"] += 1
        conn.send(encode_header(FrameType.ACK, f.rid, f.layer, f.block, f.nblocks))
