"""The prefill side: ``CacheStoreSender`` sends each stored layer to the request's receiver.

Request lifecycle on the sender:

1. ``bind(rid, endpoint, dst_block_ids, token)``: the decode's endpoint bytes, the
   destination list it returned from ``expect`` (-1 = already there, skip) and that list's bind
   token (``Destination.token``: the default when the list is one). Version and
   compatibility hash are checked here (``CompatError`` with both values); the link to that
   receiver is reused or opened (``link.py``; with ``tls`` each connection is mutual TLS), and
   BIND(rid, token) is queued on it. Every DATA frame (NIXL notification record) of rid carries the
   token too: the receiver refuses KV for rid with any other.
2. ``store(rid, layer, src_block_ids, first=0)``: called from the engine's compute thread right
   after that layer's KV is written (all of a layer's blocks at once, or, from a chunked prefill,
   in parts in block order: ``first`` is where the part starts among the destination blocks).
   On a GPU the writes are queued on its stream; the region's ``layer_written`` gives the event
   the link's thread waits on before it reads, so the engine never waits for its own layer.
   Thread-safe and non-blocking: pairs src[i] -> dst[first + i], merges runs contiguous on both
   sides, and pushes one Transfer to the link's scheduler.
3. The link's threads send it (tcp DATA frames straight from the region, or NIXL WRITEs);
   the receiver ACKs each frame (tcp) / NIXL reports each WRITE done.
4. ``await wait_sent(rid)`` returns once every layer of the layout was stored and delivered.
5. ``delete(rid)`` forgets the request (idempotent). Deleting an unfinished request drops its
   queued chunks and sends CANCEL, so the receiver frees its entry. Source blocks are read
   until ``wait_sent`` returns (or the request fails/is deleted): the engine must not reuse
   them before that. ``delete`` (and a failure) releases the request's pin at once, exactly
   once: a chunk already on the wire finishes on its link (``stats()['sending_chunks']``) but
   its completion is a no-op. (A NIXL WRITE's completion can wait on the receiver's agent;
   a pin held until then outlived the request whenever the receiver stopped progressing.)
   The link itself is bounded by ``stall_timeout_s`` (default 30 s): a receiver that takes
   no byte (tcp) or completes no WRITE (nixl) for that long, e.g. a frozen one, fails the
   link (its requests fail, its sockets close, ``sending_chunks`` drops to 0) and the next
   ``bind`` to that receiver opens a new one.

Same node (``same_node``, ``samenode.py``): when the receiver's endpoint offers its region and this
process can map it (same machine; cpu: a memfd it may open; cuda: a CUDA IPC handle it may open),
the link to that receiver copies each layer straight into it and tells the receiver with a WRITTEN
frame on the control connection (``samenode_link.py``); the lifecycle, checksums and failures are
those of tcp (a layer counts delivered on the receiver's ACK). ``"auto"`` (default) falls back to the
sender's transport, logged once a receiver; ``"on"`` makes ``bind`` raise TransferError instead;
``"off"`` never maps.

Failures (receiver gone, ERROR from the receiver, a wait's timeout) fail the request: its
waiters get ``TransferError`` and it is freed; later ``store`` calls for it are ignored. When
the receiver found the KV corrupted (``checksum=True``: every slice carries a CRC32C,
``checksum.py``) the error is a ``ChecksumError``. tcp: a corrupted slice is never ACKed, so
``wait_sent`` raises. nixl: a WRITE counts as delivered when NIXL reports it done, before the
receiver checked it, so ``wait_sent`` may already have returned; the receiver's wait fails
instead (the decode then reports the request failed on its Session).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from .endpoint import Endpoint
from .errors import CompatError, TransferError, UnknownRequestError
from .frames import TOKEN_BYTES, FrameType, encode_control
from .handshake import check_endpoint
from .link import Link, LinkConfig
from .link_model import LinkModel
from .memory import CompatInfo, KVLayout, MemoryRegion, merge_runs
from .samenode import SAME_NODE_MODES, SameNodeError, open_remote
from .samenode_link import SameNodeSend
from .scheduler import DEFAULT_MAX_WAIT, SCHEDULERS, Transfer, make_scheduler
from .tls_sockets import TlsContexts
from .transport import send_side
from .waiters import LoopCaller, WaiterBook

log = logging.getLogger("pdserve.cachestore.sender")
DEFAULT_CHUNK_BYTES = 4 << 20
TOMBSTONES = 4096


@dataclass(slots=True)
class _TxRequest:
    rid: str
    link: Link
    dst: list[int]
    token: bytes  # the receiver's bind token for rid (never logged)
    stored: dict[int, int] = field(default_factory=dict)  # layer -> destination blocks stored so far (from 0)
    pending: int = 0        # blocks handed to the link and not yet delivered
    layer_left: dict[int, int] = field(default_factory=dict)     # layer -> blocks not yet delivered
    layer_times: dict[int, list[float]] = field(default_factory=dict)  # layer -> [stored, delivered] (monotonic)
    deleted: bool = False
    error: TransferError | None = None


class CacheStoreSender:
    """Sends stored layers to bound receivers over ``tcp`` or ``nixl`` (see the module docstring)."""

    def __init__(self, region: MemoryRegion, layout: KVLayout, compat: CompatInfo, transport: str = "tcp",
                 scheduler: str = "priority", chunk_bytes: int = DEFAULT_CHUNK_BYTES, max_wait: int = DEFAULT_MAX_WAIT,
                 connections_per_peer: int = 1, connect_timeout_s: float = 5.0, checksum: bool = False,
                 stall_timeout_s: float = 30.0, corrupt_kv: int = 0, tls: TlsContexts | None = None,
                 link_model: LinkModel | None = None, same_node: str = "auto"):
        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {sorted(SCHEDULERS)}, got {scheduler!r}")
        if same_node not in SAME_NODE_MODES:
            raise ValueError(f"same_node must be one of {SAME_NODE_MODES}, got {same_node!r}")
        if chunk_bytes <= 0 or connections_per_peer <= 0 or not stall_timeout_s > 0:
            raise ValueError("chunk_bytes, connections_per_peer and stall_timeout_s must be positive")
        compat.check_layout(layout)
        region.check_layout(layout)
        self.region, self.layout, self.compat, self.transport = region, layout, compat, transport
        self.scheduler_name, self.max_wait = scheduler, max_wait
        self.chunk_blocks = max(1, chunk_bytes // layout.block_nbytes)
        self.connections_per_peer, self.connect_timeout_s = connections_per_peer, connect_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.tls = tls  # mutual TLS on every link connection (tls_sockets.py); None: plain TCP
        if link_model is not None and transport != "tcp":
            raise ValueError(f"a modelled link (link_model.py) paces the tcp transport only, got {transport!r}")
        self.link_model = link_model  # a simulated link (link_model.py), shared by every link; None: the wire's
        self._lock = threading.Lock()
        self._requests: dict[str, _TxRequest] = {}
        self._failed: OrderedDict[str, TransferError] = OrderedDict()
        self._links: dict[tuple, Link] = {}
        self._waiters: WaiterBook[None] = WaiterBook()
        self._loop = LoopCaller()
        self._transport = send_side(transport, region)  # ValueError naming the transports for another name
        self._counters = {"bytes_sent": 0, "transfers_stored": 0, "same_node_links": 0}
        self.same_node = same_node  # auto: a same-node link when the receiver's region maps here; on: only; off: never
        self._fallbacks_logged: set[str] = set()  # receiver instances whose shared region did not map (logged once)
        self.checksum = checksum
        self._corrupt_left = corrupt_kv  # test hook (checksum.py); 0 in production
        if corrupt_kv > 0:
            log.warning("TEST HOOK ACTIVE: one byte of one layer of the next %d request(s) will be corrupted in flight",
                        corrupt_kv)

    # ----- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Bind to the running event loop and start the transport (nixl: the agent, the region registered once)."""
        self._loop.attach()
        await self._transport.start()

    async def stop(self) -> None:
        """Close every link (requests still in flight fail) and deregister memory."""
        with self._lock:
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            await asyncio.to_thread(link.close)
        for rid in list(self._requests):
            self.delete(rid)
        self._transport.close()

    # ----- the API ---------------------------------------------------------------------
    def bind(self, request_id: str, endpoint: bytes, dst_block_ids: Sequence[int], token: bytes | None = None) -> None:
        """Attach request_id to a receiver: its endpoint bytes, the dst list from its ``expect`` and
        that list's bind token (default: ``dst_block_ids.token``, when it is the ``Destination`` itself).

        Raises CompatError (both values in the message) if the receiver speaks another
        protocol version or compatibility hash, ValueError for bad ids, a missing or malformed
        token or a transport mismatch.
        """
        self._loop.require("sender")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request id must be a non-empty str, got {request_id!r}")
        ep = Endpoint.from_bytes(endpoint)
        check_endpoint(ep, self.compat, self.transport)
        if token is None:
            token = getattr(dst_block_ids, "token", None)
        if not isinstance(token, bytes) or len(token) != TOKEN_BYTES:
            raise ValueError(f"request {request_id!r}: bind() needs the receiver's {TOKEN_BYTES}-byte bind token "
                             "(the Destination that expect() returned, or its token)")
        dst = KVLayout(self.layout.num_layers, max(ep.num_blocks, 1), self.layout.block_nbytes).check_blocks(
            dst_block_ids, "destination block id", allow_skip=True)
        if not dst:
            raise ValueError(f"request {request_id!r}: bind() needs at least one destination block")
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} is already bound (delete it first)")
            link = self._link_for(ep)
            self._requests[request_id] = _TxRequest(request_id, link, dst, token)
            self._failed.pop(request_id, None)
        link.send_control(encode_control(FrameType.BIND, request_id, token=token))

    def store(self, request_id: str, layer: int, src_block_ids: Sequence[int], first: int = 0) -> None:
        """Layer `layer` of request_id is written in src_block_ids: schedule its send. Any thread.

        src_block_ids[i] goes to destination block ``first + i`` of those given to bind. A layer may
        come in parts (a chunked prefill stores each chunk's blocks as they are written), in order:
        each part starts where the layer's previous one ended. Ignored if the request already
        failed (the failure surfaces in wait_sent); UnknownRequestError if it was never bound;
        ValueError for a part out of order (a block stored twice, or one skipped) or past the end.
        """
        self.layout.check_layer(layer)
        src = self.layout.check_blocks(src_block_ids, "source block id")
        # the layer's writes as of now (a CUDA event recorded by the engine): the link waits on it, not this thread
        ready = None if self.region.layer_written is None else self.region.layer_written(layer)
        with self._lock:
            req = self._requests.get(request_id)
            if req is None or req.deleted:
                if request_id in self._failed:
                    return
                raise UnknownRequestError(f"store() for request {request_id!r}, which is not bound (or was deleted)")
            if req.error is not None:
                return
            have, end = req.stored.get(layer, 0), first + len(src)
            if end > len(req.dst):
                raise ValueError(f"request {request_id!r}: layer {layer}: blocks up to {end} stored but it has "
                                 f"{len(req.dst)} destination blocks")
            if first != have:
                what = "stored twice" if first < have else f"stored with blocks [{have}, {first}) skipped"
                raise ValueError(f"request {request_id!r}: layer {layer} {what} (blocks [{first}, {end}) after "
                                 f"[0, {have}))")
            runs = merge_runs(src, req.dst[first:end])
            req.stored[layer] = end
            nblocks = sum(n for _, _, n in runs)
            req.pending += nblocks
            now = time.monotonic()
            req.layer_left[layer] = req.layer_left.get(layer, 0) + nblocks
            times = req.layer_times.setdefault(layer, [now])
            if len(times) == 1 and req.layer_left[layer] == 0 and req.stored[layer] == len(req.dst):
                times.append(now)  # nothing of the layer to send (every destination block was already there)
            self._counters["transfers_stored"] += 1
            done = self._done(req)
            link_error = None
            if runs:  # under the lock: a delete() on another thread cannot slip in before the push
                transfer = Transfer(request_id, layer, runs, token=req.token, ready=ready)
                if self._corrupt_left > 0 and layer == self.layout.num_layers // 2:
                    self._corrupt_left -= 1
                    transfer.corrupt = True
                try:
                    req.link.submit(transfer)
                except TransferError as exc:  # named for the request, as on_link_failed names it (it may come first)
                    link_error = type(exc)(f"request {request_id!r}: {exc}")
        if link_error is not None:
            self._fail(request_id, link_error, tell_receiver=False)
        elif done:
            self._loop.call(self._dispatch, request_id)

    async def wait_sent(self, request_id: str, timeout_s: float) -> None:
        """Return once every layer was stored and delivered to the receiver.

        Raises TransferError on failure or after timeout_s (the request is then freed and
        the receiver told), UnknownRequestError for an id never bound. Cancelling the caller
        only stops this wait.
        """
        self._loop.require("sender")
        await self._waiters.wait(request_id, None, timeout_s, self._ready, self._on_wait_timeout)

    def _on_wait_timeout(self, rid: str, _: object, timeout_s: float) -> TransferError:
        err = TransferError(f"request {rid!r}: KV not delivered within {timeout_s}s")
        self._fail(rid, err, tell_receiver=True)
        return err

    def layer_times(self, request_id: str) -> dict[int, tuple[float, float]]:
        """layer -> (stored, delivered) monotonic times of the layers delivered so far (until delete)."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                return {}
            return {layer: (t[0], t[1]) for layer, t in req.layer_times.items() if len(t) == 2}

    def delete(self, request_id: str) -> None:
        """Forget request_id (idempotent); an unfinished one is cancelled on the receiver too."""
        with self._lock:
            self._failed.pop(request_id, None)
            req = self._requests.pop(request_id, None)  # the pin goes here, once
            if req is None:
                return
            req.deleted = True
            unfinished = req.error is None and not self._done(req)
        link = req.link
        link.remove(request_id)
        if unfinished:
            link.send_control(encode_control(FrameType.CANCEL, request_id, b"sender deleted the request"))
        self._waiters.fail(request_id, TransferError(f"request {request_id!r} was deleted while waiting"))

    def stats(self) -> dict:
        with self._lock:
            reqs = list(self._requests.values())
            links = list(self._links.values())
        return {
            "pinned_entries": len(reqs),
            "inflight_transfers": sum(1 for r in reqs if r.pending > 0 and r.error is None and not r.deleted),
            "queued_chunks": sum(l.queued() for l in links),
            "sending_chunks": sum(l.sending for l in links),
            "links": sum(1 for l in links if l.alive),
            "waiters": self._waiters.count(),
            **self._counters,
        }

    # ----- internals -------------------------------------------------------------------
    def _link_for(self, ep: Endpoint) -> Link:
        """The pooled link to ep's receiver instance; dead links (peer restarted) are replaced."""
        key = (ep.host, ep.port, ep.instance)
        link = self._links.get(key)
        if link is not None and link.alive:
            return link
        for k in [k for k, l in self._links.items() if not l.alive or k[:2] == key[:2]]:
            stale = self._links.pop(k)
            if stale.alive:
                threading.Thread(target=stale.close, daemon=True).start()
        config = LinkConfig(self.region, self.layout, self.compat, self.chunk_blocks, self.connections_per_peer,
                            self.connect_timeout_s, self._same_node_side(ep) or self._transport, self.checksum,
                            self.stall_timeout_s, self.tls, self.link_model)
        link = Link(self, ep, make_scheduler(self.scheduler_name, self.chunk_blocks, self.max_wait), config)
        self._links[key] = link
        link.start()
        return link

    def _same_node_side(self, ep: Endpoint) -> SameNodeSend | None:
        """A same-node transport for a new link to ep's receiver, or None: the sender's own (samenode.py).

        ``same_node="on"`` raises TransferError naming why the region cannot be mapped; "auto" logs it
        once per receiver instance and falls back."""
        if self.same_node == "off" or self.link_model is not None:  # a modelled link paces the tcp path it models
            return None
        try:
            needs = self.layout.num_layers * ep.num_blocks * self.layout.block_nbytes
            remote = open_remote(ep.local, self.region, needs)
        except SameNodeError as exc:
            if self.same_node == "on":
                raise TransferError(f"same-node KV transfer to {ep.host}:{ep.port} is required (same_node='on') "
                                    f"and impossible: {exc}") from None
            if ep.local and ep.instance not in self._fallbacks_logged:
                self._fallbacks_logged.add(ep.instance)
                log.info("CacheStore receiver %s:%s offers its region on this node but it does not map here (%s): "
                         "KV goes by %s", ep.host, ep.port, exc, self.transport)
            return None
        self._counters["same_node_links"] += 1
        return SameNodeSend(remote, ep.num_blocks)

    def _done(self, req: _TxRequest) -> bool:
        """Every block of every layer stored and delivered."""
        return (req.pending == 0 and len(req.stored) == self.layout.num_layers
                and all(n == len(req.dst) for n in req.stored.values()))

    def _ready(self, rid: str, _: object = None) -> bool:
        with self._lock:
            req = self._requests.get(rid)
            if req is not None and not req.deleted:
                if req.error is not None:
                    raise req.error
                return self._done(req)
            if rid in self._failed:
                raise self._failed[rid]
        raise UnknownRequestError(f"no CacheStore transfer for request {rid!r} (never bound, or already deleted)")

    def _dispatch(self, rid: str) -> None:
        self._waiters.wake(rid, self._ready)

    def _fail(self, rid: str, err: TransferError, tell_receiver: bool) -> None:
        with self._lock:
            req = self._requests.get(rid)
            if req is None or req.deleted or req.error is not None:
                return
            req.error = err
            self._failed[rid] = err
            while len(self._failed) > TOMBSTONES:
                self._failed.popitem(last=False)
            req.deleted = True
            del self._requests[rid]  # the pin goes here, once; late chunk completions find nothing
        req.link.remove(rid)
        if tell_receiver:
            req.link.send_control(encode_control(FrameType.CANCEL, rid, str(err).encode()[:60000]))
        self._loop.call(self._dispatch, rid)

    # ----- LinkOwner: called from link threads -----------------------------------------
    def on_delivered(self, rid: str, layer: int, nblocks: int) -> None:
        with self._lock:
            req = self._requests.get(rid)
            if req is None or req.error is not None or req.deleted:
                return
            req.pending -= nblocks
            left = req.layer_left.get(layer)
            if left is not None:
                req.layer_left[layer] = left - nblocks
                whole = req.stored.get(layer) == len(req.dst)  # the layer's last part is stored too
                if left - nblocks <= 0 and whole and len(req.layer_times[layer]) == 1:
                    req.layer_times[layer].append(time.monotonic())
            self._counters["bytes_sent"] += nblocks * self.layout.block_nbytes
            done = self._done(req)
        if done:
            self._loop.call(self._dispatch, rid)

    def on_remote_error(self, rid: str, err: TransferError) -> None:
        self._fail(rid, err, tell_receiver=False)

    def on_link_failed(self, link: Link, exc: BaseException) -> None:
        err_cls = CompatError if isinstance(exc, CompatError) else TransferError
        with self._lock:
            rids = [r.rid for r in self._requests.values() if r.link is link and not r.deleted]
        for rid in rids:
            self._fail(rid, err_cls(f"request {rid!r}: {exc}"), tell_receiver=False)
