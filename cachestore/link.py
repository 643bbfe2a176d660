"""One sender-side link to one receiver instance: its scheduler, connections and threads.

A ``Link`` is pooled by the sender per (host, port, receiver instance) and shared by every
request bound to that receiver. It owns:

* the link's scheduler (``scheduler.py``): every ``store()`` becomes a Transfer pushed here;
* what differs by transport comes from ``LinkConfig.transport`` (``transport.py``): how many
  connections, whether they carry DATA frames, the link's own data thread (nixl);
* ``connections`` TCP connections (nixl: one), each (with ``LinkConfig.tls``) a mutual TLS session
  first (``tls_sockets.py``), each with a writer thread (control frames, then chunks
  popped from the scheduler, sent straight from the region) and a reader thread (ACK and
  ERROR frames from the receiver). Connection 0 also carries BIND and CANCEL frames, and no
  chunk leaves on any connection or by NIXL while one of them waits to be sent (``_data_ready``);
* for ``nixl``: one data thread running a ``NixlWriter`` (``nixl_link.py``) that turns
  chunks into NIXL WRITEs (a layer or more each) with a notification and counts their chunks
  delivered when NIXL reports it DONE (TCP stays the control channel). It reaches the link
  only through ``take_chunks`` / ``chunks_done`` and ``stall_error``.

With ``LinkConfig.checksum`` every slice sent carries the CRC32C of its source bytes, computed
by the thread that sends it, right before (``checksum.py``): in the DATA header (tcp) or the
notification (nixl).

Any connection error fails the whole link: every request on it gets ``TransferError`` and
the next ``bind`` to that receiver opens a new link (so a restarted peer is reconnected).

Stalls (``LinkConfig.stall_timeout_s``): a receiver that is alive but takes nothing (frozen,
SIGSTOP) must not hold a link's threads for ever. Every link socket has ``SO_SNDTIMEO`` =
that bound, so a ``send`` that moves no byte for that long raises and fails the link; for
nixl, a WRITE still in flight with no WRITE of the link completing for that long fails the
link too (its handles are released: NIXL aborts what it can). A failed link closes its
sockets and counts none of its chunks as sending any more; the owner fails its requests.
"""

from __future__ import annotations

import collections
import errno
import logging
import socket
import ssl
import struct
import threading
from dataclasses import dataclass
from typing import Protocol

from .endpoint import Endpoint
from .errors import ChecksumError, CompatError, ProtocolError, TransferError
from .frames import FLAG_CHECKSUM_MISMATCH, FLAG_CRC32C, FrameType, encode_header, read_frame_header, read_payload
from .handshake import client_hello
from .link_model import LinkModel
from .memory import CompatInfo, KVLayout, MemoryRegion
from .scheduler import Chunk
from .tls_sockets import WOULD_BLOCK, TlsContexts, wrap_client
from .transport import SendSide, TcpSend
from .wire_io import RegionIO

log = logging.getLogger("pdserve.cachestore.link")


class LinkOwner(Protocol):
    """What a link reports to its owner (the sender), from the link's threads."""

    def on_delivered(self, rid: str, layer: int, nblocks: int) -> None:
        """nblocks of rid's layer reached the receiver (tcp ACK, or the NIXL WRITE is DONE)."""

    def on_remote_error(self, rid: str, err: TransferError) -> None:
        """The receiver refused or gave up on rid (ERROR rid); ``ChecksumError`` when its KV arrived corrupted."""

    def on_link_failed(self, link: "Link", exc: BaseException) -> None:
        """The link is down (connection error, handshake refused, closed): its requests fail."""


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """What every link of one sender shares, given at construction."""

    region: MemoryRegion
    layout: KVLayout
    compat: CompatInfo
    chunk_blocks: int              # a NIXL WRITE carries consecutive chunks up to this many blocks
    connections: int               # tcp connections per receiver (nixl: one, the control channel)
    connect_timeout_s: float
    transport: SendSide = TcpSend()  # the sender's transport (transport.py): connections, data thread, agent
    checksum: bool = False         # send a CRC32C with every slice (checksum.py)
    stall_timeout_s: float = 30.0  # no byte sent / no NIXL WRITE completed for this long: the link fails
    tls: TlsContexts | None = None  # mutual TLS on every connection (tls_sockets.py); None: plain TCP
    link_model: LinkModel | None = None  # a simulated link (link_model.py): paces every slice; None: the wire's speed


def _stalled(exc: BaseException) -> bool:
    """An OSError that SO_SNDTIMEO produced (send took no byte within the timeout; TLS: SSLWantWriteError)."""
    return isinstance(exc, WOULD_BLOCK) or (isinstance(exc, OSError) and exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK))


class Link:
    def __init__(self, owner: LinkOwner, endpoint: Endpoint, scheduler, config: LinkConfig):
        self.owner = owner
        self.config = config
        self.endpoint = endpoint
        self.key = (endpoint.host, endpoint.port, endpoint.instance)
        self.peer = f"{endpoint.host}:{endpoint.port}"
        self.scheduler = scheduler
        self.cond = threading.Condition()
        self.control: collections.deque[bytes] = collections.deque()
        self.alive = True
        self.closing = False
        self.error: BaseException | None = None
        self.sending = 0  # chunks popped and not yet fully sent/acknowledged by NIXL
        self.control_sending = 0  # control frames popped and not yet handed to the kernel
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._n_conns = config.transport.connections(config.connections)

    # ----- called by the sender (any thread) -------------------------------------------
    def start(self) -> None:
        for i in range(self._n_conns):
            self._spawn(self._conn_main, f"cachestore-tx-{self.peer}-c{i}", i)
        if self.config.transport.has_data_thread:
            self._spawn(self._data_main, f"cachestore-tx-{self.peer}-{self.config.transport.name}")

    def submit(self, transfer) -> None:
        with self.cond:
            if not self.alive:
                cls = CompatError if isinstance(self.error, CompatError) else TransferError
                raise cls(f"link to {self.peer} is down: {self.error}")
            self.scheduler.push(transfer)
            self.cond.notify_all()

    def send_control(self, frame: bytes) -> None:
        with self.cond:
            if self.alive:
                self.control.append(frame)
                self.cond.notify_all()

    def remove(self, rid: str) -> int:
        with self.cond:
            return self.scheduler.remove(rid)

    def queued(self) -> int:
        with self.cond:
            return len(self.scheduler)

    # ----- called by the link's data threads (nixl_link.NixlWriter) --------------------
    def take_chunks(self, max_blocks: int, max_chunks: int, wait: bool) -> list[Chunk] | None:
        """For a data thread: pop consecutive chunks, up to max_chunks and until max_blocks is reached.

        With ``wait``, block until a chunk is queued. None once the link is down. Each chunk
        popped counts in ``sending`` until the thread reports it with ``chunks_done``."""
        with self.cond:
            while wait and self.alive and not self._data_ready():
                self.cond.wait()
            if not self.alive:
                return None
            batch: list[Chunk] = []
            size = 0
            while self._data_ready() and size < max_blocks and len(batch) < max_chunks:
                chunk = self.scheduler.pop()
                self.sending += 1
                batch.append(chunk)
                size += chunk.nblocks
        for chunk in batch:  # outside the lock: the engine thread keeps storing layers meanwhile
            chunk.transfer.wait_ready()
        return batch

    def _data_ready(self) -> bool:
        """(Under ``cond``.) A chunk is queued and no control frame waits to be sent before it.

        Control frames go first: a request's BIND is in the kernel before any of its bytes move on
        another connection or by NIXL, so a sender that dies after its data moved always leaves
        the receiver a bound entry to fail (else the receiver waits out its expect timeout)."""
        return bool(len(self.scheduler)) and not self.control and not self.control_sending

    def chunk_done(self, chunk: Chunk, acked: bool) -> None:
        """A data thread is done with a popped chunk; ``acked``: it reached the receiver."""
        self.chunks_done([chunk], acked)

    def chunks_done(self, chunks: list[Chunk], acked: bool) -> None:
        """A data thread is done with popped chunks (one NIXL WRITE): one count, one delivery per layer."""
        with self.cond:
            self.sending -= len(chunks)
        if not acked:
            return
        delivered: dict[tuple, int] = {}
        for chunk in chunks:
            key = (chunk.transfer.key, chunk.transfer.layer)
            delivered[key] = delivered.get(key, 0) + chunk.nblocks
        for (rid, layer), nblocks in delivered.items():
            self.owner.on_delivered(rid, layer, nblocks)

    def fail(self, exc: BaseException) -> None:
        with self.cond:
            if not self.alive:
                return
            self.alive = False
            self.error = exc
            self.cond.notify_all()
        if not self.closing:
            log.warning("CacheStore link to %s failed: %s", self.peer, exc)
        self._shutdown_socks()
        self.owner.on_link_failed(self, exc)

    def close(self) -> None:
        """Stop the threads (queued chunks are dropped) and wait for them."""
        self.closing = True
        self.fail(TransferError(f"link to {self.peer} closed by the sender"))
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(10)

    # ----- threads ---------------------------------------------------------------------
    def _spawn(self, target, name: str, *args) -> threading.Thread:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(t)
        t.start()
        return t

    def _shutdown_socks(self) -> None:
        for s in list(self._socks):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _connect(self) -> socket.socket:
        ep = self.endpoint
        try:
            sock = socket.create_connection((ep.host, ep.port), timeout=self.config.connect_timeout_s)
        except OSError as exc:
            raise TransferError(f"cannot connect to CacheStore receiver {self.peer}: {exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.config.tls is not None:  # the handshake first, within the connect timeout (tls_sockets.py)
            sock = wrap_client(sock, self.config.tls, self.peer, self.config.connect_timeout_s)
        self._socks.append(sock)
        try:
            client_hello(sock, self.config.compat, self.config.transport.agent, self.peer, self.config.checksum)
        except ssl.SSLError as exc:  # TLS 1.3: the receiver's verdict on our certificate arrives with its first reply
            raise TransferError(f"CacheStore receiver {self.peer} refused this sender at the TLS handshake: "
                                f"{exc.reason or exc}") from None
        sock.settimeout(None)
        # a send that moves no byte within the stall bound raises (EAGAIN) instead of blocking
        # for ever on a receiver that is alive but frozen; reads are not bounded (idle is fine)
        sec = self.config.stall_timeout_s
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", int(sec), int((sec - int(sec)) * 1e6)))
        return sock

    def stall_error(self, what: str) -> TransferError:
        return TransferError(f"{what} to receiver {self.peer} made no progress for {self.config.stall_timeout_s}s "
                             "(receiver frozen or not reading): link closed")

    def _close_sock(self, sock: socket.socket | None, reader: threading.Thread | None) -> None:
        """After the link failed: let the reader leave its recv (the socket is shut down), then close."""
        if sock is None:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if reader is not None and reader is not threading.current_thread():
            reader.join(10)
        sock.close()

    def _conn_main(self, index: int) -> None:
        sock, reader = None, None
        try:
            sock = self._connect()
            reader = self._spawn(self._reader_main, f"cachestore-tx-{self.peer}-r{index}", sock)
            io = RegionIO(self.config.region) if self.config.transport.frames_carry_data else None
            layout = self.config.layout
            while True:
                frame, chunk = None, None
                with self.cond:
                    while (self.alive and not (index == 0 and self.control)
                           and not (io is not None and self._data_ready())):
                        self.cond.wait()
                    if not self.alive:
                        return
                    if index == 0 and self.control:
                        frame = self.control.popleft()
                        self.control_sending += 1
                    else:
                        chunk = self.scheduler.pop()
                        self.sending += 1
                if frame is not None:
                    try:
                        sock.sendall(frame)
                    finally:
                        with self.cond:
                            self.control_sending -= 1
                            self.cond.notify_all()
                    continue
                assert chunk is not None and io is not None  # no control frame: a chunk, taken only with io (the wait)
                try:
                    t = chunk.transfer
                    t.wait_ready()  # a GPU layer still being written: its event, outside the lock
                    for src, dst, n in chunk.slices:
                        nbytes = n * layout.block_nbytes
                        offset = layout.offset(t.layer, src)
                        crc = io.crc(offset, nbytes) if self.config.checksum else 0
                        if self.config.link_model is not None:
                            self.config.link_model.wait(nbytes)
                        payload = None
                        if t.corrupt:  # test hook: send a copy with one byte flipped (the source is untouched)
                            t.corrupt = False
                            payload = io.copy_out(offset, nbytes)
                            payload[0] ^= 0xFF
                            log.warning("TEST HOOK: corrupting one byte of request %r layer %d", t.key, t.layer)
                        io.send(sock, offset, nbytes,
                                encode_header(FrameType.DATA, t.key, t.layer, dst, n, nbytes,
                                              FLAG_CRC32C if self.config.checksum else 0, crc, t.token), payload)
                finally:
                    self.chunk_done(chunk, acked=False)
        except BaseException as exc:  # noqa: BLE001 - every failure fails the link
            self.fail(self.stall_error("sending") if _stalled(exc) else exc)
        finally:
            if not self.alive:
                self._close_sock(sock, reader)

    def _reader_main(self, sock: socket.socket) -> None:
        try:
            while True:
                frame = read_frame_header(sock)
                if frame is None:
                    raise TransferError(f"receiver {self.peer} closed the connection")
                if frame.type == FrameType.ACK:
                    read_payload(sock, frame)
                    self.owner.on_delivered(frame.rid, frame.layer, frame.nblocks)
                elif frame.type == FrameType.ERROR:
                    text = read_payload(sock, frame).decode(errors="replace")
                    if not frame.rid:
                        raise TransferError(f"receiver {self.peer} closed the connection: {text}")
                    cls = ChecksumError if frame.flags & FLAG_CHECKSUM_MISMATCH else TransferError
                    self.owner.on_remote_error(frame.rid,
                                               cls(f"request {frame.rid!r} failed: receiver {self.peer}: {text}"))
                else:
                    raise ProtocolError(f"unexpected {frame.type.name} frame from receiver {self.peer}")
        except BaseException as exc:  # noqa: BLE001
            self.fail(exc)

    def _data_main(self) -> None:
        """The transport's data thread (nixl: ``nixl_link.NixlWriter``) until the link is down; any error fails it."""
        try:
            self.config.transport.run_data_thread(self)
        except BaseException as exc:  # noqa: BLE001
            self.fail(exc)
