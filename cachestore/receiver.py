"""The decode side: ``CacheStoreReceiver`` pins entries, receives KV into them, wakes waiters.

Request lifecycle on the receiver (read ``entries.py`` for the bookkeeping):

1. ``expect(rid, dst_block_ids, timeout_s)`` pins an entry: the blocks the decode allocated.
   It returns the destination list to give the sender (-1 where a shared block, same hash,
   is already provided by another live entry).
2. The sender connects (with ``tls``: a mutual TLS handshake first; then HELLO: version +
   compatibility hash, refused on mismatch), sends BIND(rid, token) on its control connection
   (a wrong token: refused, the entry untouched), then DATA frames (tcp) or NIXL WRITEs + notifications
   (nixl). Each frame's bytes land straight in the entry's blocks; the frame is checked first
   (request known, blocks allocated to it), otherwise nothing is written and the sender gets ERROR.
3. ``await load(rid, layer)`` / ``await wait_all(rid)`` subscribe and are woken when the layer
   / all layers have arrived. No polling, no thread held: each wait is an asyncio future.
   With checksums (``checksum.py``) each slice is summed where it landed before it counts as
   arrived; a mismatch fails the entry with ``ChecksumError`` (naming the layer), counts
   ``checksum_mismatches``, calls ``on_checksum_mismatch(rid, layer)`` and sends the sender
   ERROR with FLAG_CHECKSUM_MISMATCH, so waits never return for corrupted KV.
4. ``delete(rid)`` unpins. A failure (sender connection lost, CANCEL, expect timeout, a wait's
   timeout, a rejected frame) unpins too, and every waiter gets ``TransferError``. If KV was
   still arriving, a frame being received stops within one 1 MiB piece (the rest is read
   and dropped); ``await released(rid)`` says when no byte can land in its blocks any more.
   A frame whose sender stopped mid-way (frozen) is cut: after ``stall_timeout_s`` with no
   byte its connection is closed, then ``released`` returns (tcp; nixl: see the README).

Threads: ``tcp_server.py`` (accept, one reader per sender connection: blocking ``recv_into``
straight into the region releases the GIL) and for nixl ``nixl_receive.py`` (notifications).
They only touch the lock-protected ``EntryTable`` and report to this class as its
``ReceiveSink``, which hands wake-ups to the event loop. ``expect``/``delete``/``stats`` and the
waits run on the loop thread (``waiters.py``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Callable, Iterable, Sequence

from .endpoint import Endpoint
from .entries import Destination, Entry, EntryTable
from .errors import ChecksumError, TransferError, UnknownRequestError
from .frames import FLAG_CHECKSUM_MISMATCH
from .memory import CompatInfo, KVLayout, MemoryRegion
from .samenode_receive import SameNodeReceive
from .tcp_server import TcpServer
from .tls_sockets import TlsContexts
from .transport import receive_side
from .waiters import LoopCaller, WaiterBook, check_timeout

log = logging.getLogger("pdserve.cachestore.receiver")


class CacheStoreReceiver:
    """Receives KV for expected requests over ``tcp`` or ``nixl`` (see the module docstring).

    Checksums sent by the sender are always verified. ``require_checksum`` refuses (at the
    handshake, CompatError on the sender) a sender that sends none. ``on_checksum_mismatch(rid,
    layer)`` is called on the event loop for each entry failed by a checksum mismatch (metrics).
    ``stall_timeout_s`` (tcp): a DATA frame still landing in an entry that was deleted or failed,
    with no byte arriving for this long (a frozen sender), gets its connection closed, so
    ``released`` is bounded by it (``tcp_server.py``). ``tls``: mutual TLS on every connection
    (``tls_sockets.py``); None: plain TCP. ``same_node``: offer a shareable region (a cpu pool in a
    memfd, ``engine/kv_shared.py``; any cuda pool) to senders on this machine, which then copy KV
    straight into it and send WRITTEN frames (``samenode_receive.py``); False: never.
    """

    def __init__(self, region: MemoryRegion, layout: KVLayout, compat: CompatInfo, transport: str = "tcp",
                 host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 require_checksum: bool = False, on_checksum_mismatch: Callable[[str, int], None] | None = None,
                 stall_timeout_s: float = 1.0, tls: TlsContexts | None = None, same_node: bool = True):
        compat.check_layout(layout)
        region.check_layout(layout)
        self.region, self.layout, self.compat, self.transport = region, layout, compat, transport
        self.host, self.port = host, port
        self.advertise_host = advertise_host or host
        self.instance = uuid.uuid4().hex[:12]
        self._table = EntryTable(layout)
        self._loop = LoopCaller()
        self._counters = {"bytes_received": 0, "frames_received": 0, "frames_rejected": 0, "connections_refused": 0,
                          "frames_verified": 0, "checksum_mismatches": 0, "connections_cut": 0, "tls_refused": 0,
                          "binds_refused": 0, "same_node_frames": 0}
        self.require_checksum = require_checksum
        self._on_checksum_mismatch = on_checksum_mismatch
        self._transport = receive_side(transport, region, self.instance, self._table, layout, self._counters,
                                       self.on_arrived, self.on_corrupt)
        self._server = TcpServer(region, layout, compat, self._transport.frames_carry_data, self._table, self._counters,
                                 self, require_checksum, stall_timeout_s, tls)
        # a shareable region (a cpu pool in a memfd, a cuda pool) is offered to same-node senders (samenode.py)
        self._same_node = SameNodeReceive(region, layout, self._table, self._counters, self) if same_node else None
        if self._same_node is not None and self._same_node.descriptor:
            self._server.written = self._same_node.handle
        self._waiters: WaiterBook[int | None] = WaiterBook()  # a layer, or None: all of them
        self._release_waiters: WaiterBook[None] = WaiterBook()
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._endpoint: bytes | None = None
        self._started = False

    # ----- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Start the transport (nixl: register the region once), then listen on host:port (port 0
        picks a free one)."""
        self._loop.attach()
        await self._transport.start(lambda: self._server.connections() > 0)
        self.port = self._server.listen(self.host, self.port)
        self._started = True

    async def stop(self) -> None:
        """Close every connection, fail whatever is still pinned, deregister memory."""
        threads = self._server.close() + self._transport.stop()
        for t in threads:
            await asyncio.to_thread(t.join, 10)
        for rid in self._table.live_ids():
            self._fail(rid, TransferError(f"request {rid!r}: the receiver stopped"), tell_sender=False)
            self.delete(rid)
        self._transport.close()

    @property
    def endpoint(self) -> bytes:
        """Opaque descriptor the prefill passes to ``CacheStoreSender.bind`` (address, version, hash, nixl)."""
        if not self._started:
            raise RuntimeError("call await receiver.start() before reading its endpoint")
        if self._endpoint is not None:
            return self._endpoint
        ep = Endpoint(self.advertise_host, self.port, self.transport, self.compat.compat_hash, self.compat.describe(),
                      self.instance, num_blocks=self.layout.num_blocks)
        self._transport.describe(ep)
        if self._same_node is not None:
            ep.local = self._same_node.descriptor
        self._endpoint = ep.to_bytes()
        return self._endpoint

    # ----- the API ---------------------------------------------------------------------
    def expect(self, request_id: str, dst_block_ids: Sequence[int], timeout_s: float,
               block_hashes: Sequence[object] | None = None) -> Destination:
        """Pin an entry for request_id: its KV lands in dst_block_ids (same order as the sender's blocks).

        Returns the destination list to hand to the sender's ``bind``: equal to
        dst_block_ids, except -1 where a block (same hash) is already provided by another
        live entry; its ``token`` is the request's bind token, which only the sender given it
        may present (``entries.py``): hand both to the prefill of the request's Session only.
        If not every layer has arrived within timeout_s the entry fails and is freed.
        """
        loop = self._loop.require("receiver")
        check_timeout(timeout_s)
        for_sender = self._table.expect(request_id, dst_block_ids, block_hashes)
        self._timers[request_id] = loop.call_later(timeout_s, self._expire, request_id, timeout_s)
        self._transport.wake()
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
            self._server.send_error(unfinished.conn, request_id,
                                    f"receiver deleted request {request_id!r} before all KV arrived")
        self._waiters.fail(request_id, TransferError(f"request {request_id!r} was deleted while waiting"))
        for e in others:
            self._after_fail(e, tell_sender=True)

    async def released(self, request_id: str, timeout_s: float) -> None:
        """Return once no frame can write into request_id's blocks any more.

        After ``delete`` (or a failure) of an entry whose KV was still arriving, a frame
        already being received stops within one 1 MiB piece; await this before giving the
        blocks to another request. Returns at once when nothing is being received.
        """
        self._loop.require("receiver")
        await self._release_waiters.wait(request_id, None, timeout_s, lambda rid, _: not self._table.busy(rid),
                                         self._on_release_timeout)

    @staticmethod
    def _on_release_timeout(rid: str, _: object, timeout_s: float) -> TransferError:
        return TransferError(f"request {rid!r}: a frame was still writing into its blocks after {timeout_s}s")

    def bytes_received(self) -> int:
        """KV bytes landed so far (tcp and same-node): a running total any thread may read (one dict read)."""
        return self._counters["bytes_received"]

    def stats(self) -> dict:
        s = self._table.stats()
        s["connections"] = self._server.connections()
        s["waiters"] = self._waiters.count()
        s.update(self._counters)
        return s

    # ----- waits (loop thread) ---------------------------------------------------------
    async def _wait(self, rid: str, layer: int | None, timeout_s: float) -> None:
        self._loop.require("receiver")
        await self._waiters.wait(rid, layer, timeout_s, self._ready, self._on_wait_timeout)

    def _on_wait_timeout(self, rid: str, layer: int | None, timeout_s: float) -> TransferError:
        what = "all layers" if layer is None else f"layer {layer}"
        err = TransferError(f"request {rid!r}: {what} did not arrive within {timeout_s}s")
        self._fail(rid, err, tell_sender=True)
        return err

    def _ready(self, rid: str, layer: int | None) -> bool:
        """True when done; raises the entry's TransferError or UnknownRequestError."""
        entry = self._table.status(rid)
        return entry.complete if layer is None else entry.layer_done(layer)

    def _dispatch(self, rids: Iterable[str]) -> None:
        """Loop thread: re-check and wake the subscribers of rids."""
        for rid in rids:
            self._waiters.wake(rid, self._ready)

    def _dispatch_released(self, rid: str) -> None:
        self._release_waiters.wake(rid, lambda r, _: not self._table.busy(r))

    # ----- ReceiveSink: called from the socket / notification threads ------------------
    def on_arrived(self, rids: Iterable[str]) -> None:
        rids = [r for r in rids if r in self._waiters]  # hand a wake-up over only for requests someone waits on
        if rids:
            self._loop.call(self._dispatch, rids)

    def on_fail(self, rid: str, err: TransferError) -> None:
        self._loop.call(self._fail, rid, err, False)

    def on_corrupt(self, err: ChecksumError) -> None:
        self._loop.call(self._corrupt, err)

    def on_frame_end(self, rid: str) -> None:
        if rid in self._release_waiters:
            self._loop.call(self._dispatch_released, rid)

    # ----- failures (loop thread) ------------------------------------------------------
    def _expire(self, rid: str, timeout_s: float) -> None:
        self._timers.pop(rid, None)
        try:
            if self._table.status(rid).complete:
                return
        except (TransferError, UnknownRequestError):
            return
        self._fail(rid, TransferError(f"request {rid!r}: KV did not all arrive within the "
                                      f"expect timeout of {timeout_s}s"),
                   tell_sender=True)

    def _corrupt(self, err: ChecksumError) -> None:
        """Loop thread: a slice failed its checksum. Fail the entry (once) and tell the sender."""
        rid, layer = err.request_id, err.layer
        if rid is None or layer is None:
            raise ValueError(f"a receiver's checksum error names its request and layer: {err}")
        try:
            self._table.status(rid)
        except (TransferError, UnknownRequestError):
            return  # already failed or deleted: counted (if at all) then
        log.warning("CacheStore %s", err)
        self._counters["checksum_mismatches"] += 1
        if self._on_checksum_mismatch is not None:
            try:
                self._on_checksum_mismatch(rid, layer)
            except Exception:  # noqa: BLE001 - a metrics hook must not stop the failure
                log.exception("on_checksum_mismatch hook failed")
        self._fail(rid, err, tell_sender=True)

    def _fail(self, rid: str, err: TransferError, tell_sender: bool) -> None:
        for e in self._table.fail(rid, err):
            self._after_fail(e, tell_sender)

    def _after_fail(self, entry: Entry, tell_sender: bool) -> None:
        """Loop thread: an entry failed (already unpinned); wake its waiters, maybe tell its sender."""
        timer = self._timers.pop(entry.rid, None)
        if timer is not None:
            timer.cancel()
        if tell_sender and entry.conn is not None:
            self._server.send_error(entry.conn, entry.rid, str(entry.error),
                                    FLAG_CHECKSUM_MISMATCH if isinstance(entry.error, ChecksumError) else 0)
        self._dispatch([entry.rid])
