"""The decode side: ``CacheStoreReceiver`` pins entries, receives KV into them, wakes waiters.

Request lifecycle on the receiver (read ``entries.py`` for the bookkeeping):

1. ``expect(rid, dst_block_ids, timeout_s)`` pins an entry: the blocks the decode allocated.
   It returns the destination list to give the sender (-1 where a shared block, same hash,
   is already provided by another live entry).
2. The sender connects (HELLO: version + compatibility hash, refused on mismatch), sends
   BIND(rid) on its control connection, then DATA frames (tcp) or NIXL WRITEs + notifications
   (nixl). Each frame's bytes land straight in the entry's blocks; the frame is checked first
   (request known, blocks allocated to it), otherwise nothing is written and the sender gets ERROR.
3. ``await load(rid, layer)`` / ``await wait_all(rid)`` subscribe and are woken when the layer
   / all layers have arrived. No polling, no thread held: each wait is an asyncio future.
4. ``delete(rid)`` unpins. A failure (sender connection lost, CANCEL, expect timeout, a wait's
   timeout, a rejected frame) unpins too, and every waiter gets ``TransferError``. If KV was
   still arriving, a frame being received stops within one 1 MiB piece (the rest is read
   and dropped); ``await released(rid)`` says when no byte can land in its blocks any more.

Threads: one accept thread, one reader thread per sender connection (blocking ``recv_into``
straight into the region releases the GIL), and for nixl one notification thread. They only
touch the lock-protected ``EntryTable`` and hand wake-ups to the event loop with
``call_soon_threadsafe``. ``expect``/``delete``/``stats`` and the waits run on the loop thread.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import socket
import threading
import time
import uuid
from typing import Sequence

from .endpoint import Endpoint, TRANSPORTS
from .entries import Entry, EntryTable
from .errors import ProtocolError, TransferError, UnknownRequestError
from .frames import (PROTOCOL_VERSION, Frame, FrameType, discard, encode_control, encode_header,
                     read_frame_header, read_payload)
from .memory import CompatInfo, KVLayout, MemoryRegion
from .wire_io import RegionIO

log = logging.getLogger("pdserve.cachestore.receiver")
SEND_TIMEOUT_S = 5.0  # a sender that stops reading ACK/ERROR frames for this long is dropped
IDLE_PROGRESS_S = 0.005  # nixl: how often an idle receiver drives its agent while a sender is connected


def _check_timeout(timeout_s: object) -> None:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")


class _Conn:
    """One accepted sender connection; send() may be called from any thread."""

    def __init__(self, cid: int, sock: socket.socket, peer: str):
        self.id = cid
        self.sock = sock
        self.peer = peer
        self.agent = ""  # the sender's NIXL agent name (from HELLO)
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


class CacheStoreReceiver:
    """Receives KV for expected requests over ``tcp`` or ``nixl`` (see the module docstring)."""

    def __init__(self, region: MemoryRegion, layout: KVLayout, compat: CompatInfo, transport: str = "tcp",
                 host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        compat.check_layout(layout)
        region.check_layout(layout)
        if transport == "nixl":
            from .nixl_backend import load_nixl

            load_nixl()  # clear error now, not at the first request
        self.region, self.layout, self.compat, self.transport = region, layout, compat, transport
        self.host, self.port = host, port
        self.advertise_host = advertise_host or host
        self.instance = uuid.uuid4().hex[:12]
        self._table = EntryTable(layout)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._conns: dict[int, _Conn] = {}
        self._conns_lock = threading.Lock()
        self._conn_ids = itertools.count(1)
        self._waiters: dict[str, list[tuple[int | None, asyncio.Future]]] = {}
        self._release_waiters: dict[str, list[asyncio.Future]] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._nixl = None
        self._nixl_wake = threading.Event()
        self._stopping = False
        self._endpoint: bytes | None = None
        self._counters = {"bytes_received": 0, "frames_received": 0, "frames_rejected": 0, "connections_refused": 0}

    # ----- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Listen on host:port (port 0 picks a free one) and, for nixl, register the region once."""
        self._loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(128)
        self._listener = sock
        self.port = sock.getsockname()[1]
        if self.transport == "nixl":
            from .nixl_backend import NixlMemory

            self._nixl = await asyncio.to_thread(NixlMemory, f"pdserve-rx-{self.instance}", self.region)
            self._spawn(self._nixl_loop, "cachestore-rx-nixl")
        self._spawn(self._accept_loop, "cachestore-rx-accept")

    async def stop(self) -> None:
        """Close every connection, fail whatever is still pinned, deregister memory."""
        self._stopping = True
        self._nixl_wake.set()
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
        for t in self._threads:
            await asyncio.to_thread(t.join, 10)
        for rid in self._table.live_ids():
            self._fail(rid, TransferError(f"request {rid!r}: the receiver stopped"), tell_sender=False)
            self.delete(rid)
        if self._nixl is not None:
            self._nixl.close()
            self._nixl = None

    @property
    def endpoint(self) -> bytes:
        """Opaque descriptor the prefill passes to ``CacheStoreSender.bind`` (address, version, hash, nixl)."""
        if self._listener is None:
            raise RuntimeError("call await receiver.start() before reading its endpoint")
        if self._endpoint is not None:
            return self._endpoint
        ep = Endpoint(self.advertise_host, self.port, self.transport, self.compat.compat_hash, self.compat.describe(),
                      self.instance, num_blocks=self.layout.num_blocks)
        if self._nixl is not None:
            ep.nixl_agent = self._nixl.name
            ep.nixl_metadata = self._nixl.metadata()
            ep.nixl_region = (self.region.ptr, self.region.nbytes, self.region.device_id, self._nixl.mem_type)
        self._endpoint = ep.to_bytes()
        return self._endpoint

    # ----- the API ---------------------------------------------------------------------
    def expect(self, request_id: str, dst_block_ids: Sequence[int], timeout_s: float,
               block_hashes: Sequence[object] | None = None) -> list[int]:
        """Pin an entry for request_id: its KV lands in dst_block_ids (same order as the sender's blocks).

        Returns the destination list to hand to the sender's ``bind``: equal to
        dst_block_ids, except -1 where a block (same hash) is already provided by another
        live entry. If not every layer has arrived within timeout_s the entry fails and is freed.
        """
        self._require_started()
        _check_timeout(timeout_s)
        for_sender = self._table.expect(request_id, dst_block_ids, block_hashes)
        self._timers[request_id] = self._loop.call_later(timeout_s, self._expire, request_id, timeout_s)
        self._nixl_wake.set()
        return for_sender

    async def load(self, request_id: str, layer: int, timeout_s: float) -> None:
        """Return once `layer` of request_id has arrived (subscribe if not yet).

        Raises TransferError if the transfer fails or timeout_s passes (the entry is then
        freed), UnknownRequestError for an id never expected. Cancelling the caller only
        stops this wait.
        """
        self.layout.check_layer(layer)
        await self._wait(request_id, layer, timeout_s)

    async def wait_all(self, request_id: str, timeout_s: float) -> None:
        """Return once every layer of request_id has arrived; errors as for ``load``."""
        await self._wait(request_id, None, timeout_s)

    def delete(self, request_id: str) -> None:
        """Unpin request_id (idempotent). If its KV was still arriving, the sender is told (ERROR)."""
        timer = self._timers.pop(request_id, None)
        if timer is not None:
            timer.cancel()
        unfinished, others = self._table.delete(request_id)
        if unfinished is not None and unfinished.conn is not None:
            self._send_error(unfinished.conn, request_id, f"receiver deleted request {request_id!r} before all KV arrived")
        self._wake_all(request_id, TransferError(f"request {request_id!r} was deleted while waiting"))
        for e in others:
            self._after_fail(e, tell_sender=True)

    async def released(self, request_id: str, timeout_s: float) -> None:
        """Return once no frame can write into request_id's blocks any more.

        After ``delete`` (or a failure) of an entry whose KV was still arriving, a frame
        already being received stops within one 1 MiB piece; await this before giving the
        blocks to another request. Returns at once when nothing is being received.
        """
        _check_timeout(timeout_s)
        fut = self._loop.create_future()
        self._release_waiters.setdefault(request_id, []).append(fut)
        try:
            if not self._table.busy(request_id):
                return
            await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise TransferError(f"request {request_id!r}: a frame was still writing into its blocks after {timeout_s}s") from None
        finally:
            ws = self._release_waiters.get(request_id, [])
            ws[:] = [w for w in ws if w is not fut]
            if not ws:
                self._release_waiters.pop(request_id, None)

    def _dispatch_released(self, rid: str) -> None:
        if self._table.busy(rid):
            return
        for fut in self._release_waiters.get(rid, []):
            if not fut.done():
                fut.set_result(None)

    def stats(self) -> dict:
        s = self._table.stats()
        with self._conns_lock:
            s["connections"] = len(self._conns)
        s["waiters"] = sum(len(v) for v in self._waiters.values())
        s.update(self._counters)
        return s

    # ----- waits (loop thread) ---------------------------------------------------------
    async def _wait(self, rid: str, layer: int | None, timeout_s: float) -> None:
        self._require_started()
        _check_timeout(timeout_s)
        # subscribe first, then look: a socket thread that lands the layer in between either
        # sees this waiter (and wakes it) or updated the state before the look below
        fut = self._loop.create_future()
        self._waiters.setdefault(rid, []).append((layer, fut))
        try:
            if self._ready(rid, layer):
                return
            await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            what = "all layers" if layer is None else f"layer {layer}"
            err = TransferError(f"request {rid!r}: {what} did not arrive within {timeout_s}s")
            self._fail(rid, err, tell_sender=True)
            raise err from None
        finally:
            ws = self._waiters.get(rid)
            if ws is not None:
                ws[:] = [(l, f) for l, f in ws if f is not fut]
                if not ws:
                    del self._waiters[rid]

    def _ready(self, rid: str, layer: int | None) -> bool:
        """True when done; raises the entry's TransferError or UnknownRequestError."""
        entry = self._table.status(rid)
        return entry.complete if layer is None else entry.layer_done(layer)

    def _dispatch(self, rids) -> None:
        """Loop thread: re-check and wake the subscribers of rids."""
        for rid in rids:
            ws = self._waiters.get(rid)
            if not ws:
                continue
            for layer, fut in ws:
                if fut.done():
                    continue
                try:
                    if self._ready(rid, layer):
                        fut.set_result(None)
                except TransferError as exc:
                    fut.set_exception(exc)
                except UnknownRequestError as exc:
                    fut.set_exception(TransferError(str(exc)))

    def _wake_from_thread(self, rids) -> None:
        """Socket thread: hand a wake-up to the loop only for requests someone waits on."""
        rids = [r for r in rids if r in self._waiters]
        if rids:
            self._to_loop(self._dispatch, rids)

    def _wake_all(self, rid: str, exc: TransferError) -> None:
        for _, fut in self._waiters.get(rid, []):
            if not fut.done():
                fut.set_exception(exc)

    def _expire(self, rid: str, timeout_s: float) -> None:
        self._timers.pop(rid, None)
        try:
            if self._table.status(rid).complete:
                return
        except (TransferError, UnknownRequestError):
            return
        self._fail(rid, TransferError(f"request {rid!r}: KV did not all arrive within the expect timeout of {timeout_s}s"),
                   tell_sender=True)

    def _fail(self, rid: str, err: TransferError, tell_sender: bool) -> None:
        for e in self._table.fail(rid, err):
            self._after_fail(e, tell_sender)

    def _after_fail(self, entry: Entry, tell_sender: bool) -> None:
        """Loop thread: an entry failed (already unpinned); wake its waiters, maybe tell its sender."""
        timer = self._timers.pop(entry.rid, None)
        if timer is not None:
            timer.cancel()
        if tell_sender and entry.conn is not None:
            self._send_error(entry.conn, entry.rid, str(entry.error))
        self._dispatch([entry.rid])

    def _send_error(self, cid: int, rid: str, text: str) -> None:
        with self._conns_lock:
            conn = self._conns.get(cid)
        if conn is not None:
            conn.send(encode_control(FrameType.ERROR, rid, text.encode()[:60000]))

    def _require_started(self) -> None:
        if self._loop is None:
            raise RuntimeError("call await receiver.start() first")

    def _to_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during shutdown
            pass

    # ----- socket threads --------------------------------------------------------------
    def _spawn(self, target, name: str, *args) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                            int(SEND_TIMEOUT_S).to_bytes(8, "little") + (0).to_bytes(8, "little"))
            conn = _Conn(next(self._conn_ids), sock, f"{addr[0]}:{addr[1]}")
            with self._conns_lock:
                self._conns[conn.id] = conn
            self._spawn(self._serve, f"cachestore-rx-conn{conn.id}", conn)

    def _serve(self, conn: _Conn) -> None:
        reason = "sender connection closed before all KV arrived"
        io = None
        try:
            if not self._handshake(conn):
                return
            io = RegionIO(self.region) if self.transport == "tcp" else None
            scratch = memoryview(bytearray(1 << 16))
            while True:
                frame = read_frame_header(conn.sock)
                if frame is None:
                    return
                if frame.type == FrameType.DATA and io is not None:
                    self._on_data(conn, frame, io, scratch)
                elif frame.type == FrameType.BIND:
                    read_payload(conn.sock, frame)
                    try:
                        self._table.bind(frame.rid, conn.id)
                    except UnknownRequestError as exc:
                        conn.send(encode_control(FrameType.ERROR, frame.rid, str(exc).encode()))
                elif frame.type in (FrameType.CANCEL, FrameType.ERROR):
                    text = read_payload(conn.sock, frame).decode(errors="replace")
                    if frame.rid:
                        err = TransferError(f"request {frame.rid!r}: the sender gave up: {text}")
                        self._to_loop(self._fail, frame.rid, err, False)
                    else:
                        log.warning("sender %s reported: %s", conn.peer, text)
                else:
                    raise ProtocolError(f"unexpected {frame.type.name} frame from a sender")
        except ProtocolError as exc:
            reason = f"connection from {conn.peer} closed: {exc}"
            log.warning("CacheStore %s", reason)
            self._counters["frames_rejected"] += 1
            conn.send(encode_control(FrameType.ERROR, "", str(exc).encode()))
        except OSError as exc:
            reason = f"sender connection {conn.peer} failed: {exc}"
        finally:
            with self._conns_lock:
                self._conns.pop(conn.id, None)
            conn.close()
            failed = self._table.fail_connection(conn.id, reason)
            if failed:
                self._to_loop(self._dispatch, [e.rid for e in failed])

    def _handshake(self, conn: _Conn) -> bool:
        frame = read_frame_header(conn.sock)
        if frame is None:
            return False
        if frame.type != FrameType.HELLO:
            raise ProtocolError(f"first frame must be HELLO, got {frame.type.name}")
        try:
            hello = json.loads(read_payload(conn.sock, frame))
            version, their_hash = int(hello["version"]), str(hello["compat_hash"])
        except (ValueError, KeyError, TypeError):
            raise ProtocolError("HELLO payload is not the expected JSON") from None
        if version != PROTOCOL_VERSION or their_hash != self.compat.compat_hash:
            self._counters["connections_refused"] += 1
            text = (f"incompatible peers: receiver speaks protocol {PROTOCOL_VERSION} with compat hash "
                    f"{self.compat.compat_hash} ({self.compat.describe()}), sender speaks protocol {version} with "
                    f"compat hash {their_hash} ({hello.get('compat', '?')})")
            log.warning("refused %s: %s", conn.peer, text)
            conn.send(encode_control(FrameType.ERROR, "", text.encode()))
            return False
        conn.agent = str(hello.get("agent", ""))
        conn.send(encode_control(FrameType.HELLO_OK, "", b"{}"))
        return True

    def _on_data(self, conn: _Conn, f: Frame, io: RegionIO, scratch: memoryview) -> None:
        nbytes = f.nblocks * self.layout.block_nbytes
        if f.payload_len != nbytes or f.nblocks == 0 or f.block + f.nblocks > self.layout.num_blocks:
            raise ProtocolError(f"DATA frame for {f.rid!r}: {f.nblocks} blocks from block {f.block} with a payload of "
                                f"{f.payload_len} bytes does not fit blocks of {self.layout.block_nbytes} bytes")
        try:
            entry = self._table.begin_receive(f.rid, f.layer, f.block, f.nblocks)
        except (UnknownRequestError, ProtocolError) as exc:
            discard(conn.sock, f.payload_len, scratch)
            self._counters["frames_rejected"] += 1
            if isinstance(exc, ProtocolError):  # a known request writing outside its blocks: fail it
                self._to_loop(self._fail, f.rid, TransferError(str(exc)), False)
            conn.send(encode_control(FrameType.ERROR, f.rid, str(exc).encode()))
            return
        ok = False
        try:
            ok = io.recv(conn.sock, self.layout.offset(f.layer, f.block), nbytes,
                         stop=lambda: entry.deleted or entry.error is not None, scratch=scratch)
        finally:
            touched = self._table.end_receive(f.rid, f.layer, f.block, f.nblocks, ok)
            self._wake_from_thread(touched)
            if f.rid in self._release_waiters:
                self._to_loop(self._dispatch_released, f.rid)
        if not ok:  # the entry went away mid-frame; the sender has been told by delete/fail
            return
        self._counters["bytes_received"] += nbytes
        self._counters["frames_received"] += 1
        conn.send(encode_header(FrameType.ACK, f.rid, f.layer, f.block, f.nblocks))

    def _nixl_loop(self) -> None:
        """Drain NIXL notifications (each: the bytes of one WRITE have landed) and mark arrivals.

        NIXL's Python API offers no blocking wait, so this thread polls the agent with a
        backoff up to 0.2 ms while some entry still waits for KV, and sleeps on an Event
        (re-checked every 0.5 s) when none does.
        """
        from .nixl_backend import decode_notif

        idle = 0
        while not self._stopping:
            waiting = self._table.incomplete > 0
            if not waiting:
                # No entry waits for KV, but a connected sender may still have WRITEs in flight
                # toward us (for an entry deleted, failed or never expected): UCX completes them
                # on the sender only once this agent makes progress too, so keep driving it,
                # slowly, while any sender is connected.
                with self._conns_lock:
                    connected = bool(self._conns)
                self._nixl_wake.wait(IDLE_PROGRESS_S if connected else 0.5)
                self._nixl_wake.clear()
                if not connected:
                    continue
            notifs = self._nixl.agent.get_new_notifs()
            if not notifs:
                if waiting:
                    idle += 1
                    time.sleep(min(0.0002, 0.00001 * idle))
                continue
            idle = 0
            touched: set[str] = set()
            for msgs in notifs.values():
                for msg in msgs:
                    try:
                        records = decode_notif(msg)
                    except ProtocolError as exc:
                        log.warning("dropped a NIXL notification: %s", exc)
                        continue
                    for rid, layer, block, n in ((r, l, b, n) for r, l, sl in records for b, n in sl):
                        try:
                            self._table.begin_receive(rid, layer, block, n)
                        except (UnknownRequestError, ProtocolError) as exc:
                            self._counters["frames_rejected"] += 1
                            log.warning("NIXL write rejected: %s", exc)
                            continue
                        touched |= self._table.end_receive(rid, layer, block, n, True)
                        self._counters["bytes_received"] += n * self.layout.block_nbytes
                        self._counters["frames_received"] += 1
            self._wake_from_thread(touched)
