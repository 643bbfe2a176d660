"""KV events of one server process: its prefix cache's hash set, numbered and streamed.

The correctness protocol is stated in ``protos/kv_events.proto``; this module is the
publishing end (prefills publish for routers, decodes for prefills' decode pickers), and
``pdserve/kv_index.py`` (fed by ``kv_follow.py``, or the router's watch) the receiving end.
``leading(hashes)`` answers the publishing process itself: how much of a prompt its own
prefix cache holds (the prefill's cost model asks).

Lifecycle of one event:

1. The engine thread changes the prefix cache; the BlockManager calls its listener, a
   ``KvEventPublisher`` (``stored`` / ``removed`` / ``cleared``).
2. Under the publisher's lock: the event gets the next ``seq``, the publisher's mirror of the
   hash set is updated, and the event is handed to each subscriber's asyncio queue with
   ``loop.call_soon_threadsafe`` (so it reaches the event loop in seq order). A subscriber
   with ``max_pending`` events not yet taken gets none until it catches up: the gap in seq
   tells it to resubscribe.
3. ``KvEventsServicer.Subscribe`` (on the event loop) sends the snapshot taken when the
   subscription began (under the same lock, so events after it are exactly seq+1, ...),
   then every batch of queued events, as ``KvEventBatch`` messages.

What the hash set means: every block hash a prompt can reuse on this server without computing
it, in the KV pool or in a lower tier (``--kv-host-tier-bytes``, ``--kv-disk-tier-*``;
``engine/kv_tiers.py``), since a tier hit is copied back, not recomputed. So a block moving from
the pool to a tier (or back) publishes nothing; BLOCK_REMOVED means it left the last tier (or
failed its checksum on the way back). Routers and decode pickers therefore count tiered blocks
as hits, and ``leading`` does too: the prefill's cost model treats them as held.

Only plain tuples cross the thread boundary; protobuf messages are built on the event loop.
Who frees: a subscription is removed when its stream ends (the client leaves, the server stops).

The servicer also answers the server's load: ``GetLoad`` once, ``WatchLoad`` as a stream (routers read
one stream per prefill instead of polling: ``router/prefill_watch.py``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import uuid
from dataclasses import dataclass, field
from typing import Callable

from pdserve.protos import kv_events_pb2 as kpb
from pdserve.protos import kv_events_pb2_grpc as kpb_grpc
from pdserve.protos.version import KV_EVENTS_VERSION

log = logging.getLogger(__name__)

STORED, REMOVED, CLEARED = kpb.KvEvent.BLOCK_STORED, kpb.KvEvent.BLOCK_REMOVED, kpb.KvEvent.ALL_CLEARED
LOAD_PUSH_DEFAULT_S = 0.2  # WatchLoad's period when the caller names none (the router's --load-interval default)
LOAD_PUSH_MIN_S = 0.01  # the shortest period WatchLoad pushes at, whatever the caller asks


@dataclass(eq=False, slots=True)
class Subscription:
    """One subscriber: its queue on the event loop and the snapshot it starts from."""

    loop: asyncio.AbstractEventLoop
    snapshot_seq: int
    snapshot: list[int]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    pending: int = 0  # events handed to the queue and not yet taken (guarded by the publisher's lock)
    dropped: int = 0


class KvEventPublisher:
    """A ``PrefixCacheListener`` (engine/block_manager.py) that numbers events and fans them out."""

    def __init__(self, block_size: int, max_pending: int = 10_000, epoch: str | None = None):
        self.epoch = epoch or uuid.uuid4().hex
        self.block_size, self.max_pending = block_size, max_pending
        self._lock = threading.Lock()
        self._seq = 0
        self._hashes: set[int] = set()
        self._subs: list[Subscription] = []

    # ---- listener side: the engine thread ------------------------------------------------
    def stored(self, hashes: list[int]) -> None:
        self._publish(STORED, hashes)

    def removed(self, hashes: list[int]) -> None:
        self._publish(REMOVED, hashes)

    def cleared(self) -> None:
        self._publish(CLEARED, [])

    def _publish(self, kind: int, hashes: list[int]) -> None:
        with self._lock:
            self._seq += 1
            if kind == STORED:
                self._hashes.update(hashes)
            elif kind == REMOVED:
                self._hashes.difference_update(hashes)
            else:
                self._hashes.clear()
            event = (self._seq, kind, tuple(hashes))
            for sub in self._subs:
                if sub.pending >= self.max_pending:
                    sub.dropped += 1  # the subscriber sees the gap and resyncs
                    continue
                sub.pending += 1
                try:
                    sub.loop.call_soon_threadsafe(sub.queue.put_nowait, event)
                except RuntimeError:  # its loop is closed: the stream is over
                    sub.pending -= 1

    # ---- subscriber side: the event loop -------------------------------------------------
    @property
    def seq(self) -> int:
        """The number of the last event published (0: none yet)."""
        with self._lock:
            return self._seq

    def snapshot(self) -> tuple[int, list[int]]:
        """(seq, every hash) as of that seq."""
        with self._lock:
            return self._seq, sorted(self._hashes)

    def leading(self, hashes: list[int]) -> int:
        """How many of ``hashes`` (a prompt's chained block hashes, in order) the cache holds, from the first on."""
        with self._lock:
            n = 0
            for h in hashes:
                if h not in self._hashes:
                    break
                n += 1
            return n

    def subscribe(self) -> Subscription:
        with self._lock:
            sub = Subscription(asyncio.get_running_loop(), self._seq, sorted(self._hashes))
            self._subs.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    def num_subscribers(self) -> int:
        with self._lock:
            return len(self._subs)

    async def next_events(self, sub: Subscription) -> list[tuple[int, int, tuple[int, ...]]]:
        """Wait for at least one event; return every event queued for ``sub`` (seq order)."""
        events = [await sub.queue.get()]
        while not sub.queue.empty():
            events.append(sub.queue.get_nowait())
        with self._lock:
            sub.pending -= len(events)
        return events

    def snapshot_message(self, seq: int, hashes: list[int]) -> kpb.KvEvent:
        return kpb.KvEvent(epoch=self.epoch, seq=seq, kind=kpb.KvEvent.SNAPSHOT, block_hashes=hashes,
                           block_size=self.block_size, version=KV_EVENTS_VERSION)


class KvEventsServicer(kpb_grpc.KvEventsServicer):
    """gRPC ``KvEvents``: Subscribe (snapshot, then events), Snapshot, GetLoad (``load_fn()``)."""

    def __init__(self, publisher: KvEventPublisher, load_fn: Callable[[], kpb.ServerLoad]):
        self.publisher, self.load_fn = publisher, load_fn

    async def Subscribe(self, request, context):
        pub = self.publisher
        sub = pub.subscribe()
        log.info("kv events: %s subscribed at seq %d", request.subscriber or context.peer(), sub.snapshot_seq)
        try:
            yield kpb.KvEventBatch(events=[pub.snapshot_message(sub.snapshot_seq, sub.snapshot)])
            sub.snapshot = []
            while True:
                events = await pub.next_events(sub)
                yield kpb.KvEventBatch(events=[kpb.KvEvent(epoch=pub.epoch, seq=seq, kind=kind, block_hashes=hashes)
                                               for seq, kind, hashes in events])
        finally:
            pub.unsubscribe(sub)

    async def Snapshot(self, request, context):
        return self.publisher.snapshot_message(*self.publisher.snapshot())

    def load(self) -> kpb.ServerLoad:
        """The server's load now, with its publisher's epoch and block size."""
        load = self.load_fn()
        load.epoch = self.publisher.epoch
        load.block_size = self.publisher.block_size
        return load

    async def GetLoad(self, request, context):
        return self.load()

    async def WatchLoad(self, request, context):
        """GetLoad's answer at once, then every ``interval_ms`` (at least LOAD_PUSH_MIN_S; 0: LOAD_PUSH_DEFAULT_S)
        until the caller leaves. The first pause is a random part of the period, so the streams a router opens
        together (one per prefill) do not all push in the same instant."""
        period = max(LOAD_PUSH_MIN_S, request.interval_ms / 1000 if request.interval_ms else LOAD_PUSH_DEFAULT_S)
        pause = period * random.random()
        while True:
            yield self.load()
            await asyncio.sleep(pause)
            pause = period
