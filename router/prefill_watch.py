"""PrefillWatch: one prefill as the router sees it, over one gRPC channel.

Two tasks per prefill:

1. **events** - ``pdserve.kv_follow.follow`` (the one follower of KV-event streams): the
   snapshot, then events, into the PrefixIndex. A verdict of gap / epoch / unsynced cancels
   the stream and subscribes again at once (the new stream starts with a snapshot). A broken
   stream (the prefill died or restarted) forgets its hashes at once and retries with backoff
   (0.1 s doubling to 2 s); the next snapshot's reason tells a restart (``epoch``) from a
   reconnect (``resync``), each counted in ``router_index_resyncs``. A snapshot of another
   KV_EVENTS_VERSION is not used (the prefill is still routed to, by load alone). A snapshot is one
   gRPC message of every hash the prefill holds: the channel takes up to ``KV_EVENTS_MAX_MESSAGE_BYTES``.
2. **load** - in flight, free blocks, ready, and the port of its HTTP API, every ``interval_s``:
   pushed by the prefill on one ``KvEvents.WatchLoad`` stream (a message read costs the router
   a fraction of a poll's call: at 64 prefills the polls were most of its idle core), or, from a
   prefill without it (UNIMPLEMENTED: an older server), polled with ``KvEvents.GetLoad``. A failed
   poll, or a stream that breaks or stays silent for a poll's timeout, makes the prefill
   unroutable at once; a report older than ``expiry_s`` does not count. The first report is
   asked at once; a poll's pause after it is a part of ``interval_s`` set by the address
   (``poll_phase``; the prefill spreads its pushes the same way), so the watches a router starts
   together (at its start, 64 of them) report spread over the interval, not in one burst of
   replies every interval that holds the event loop, and the requests on it, for all at once.

Both tasks run on the event loop, which owns the index: no locks.
"""

from __future__ import annotations

import asyncio
import time
import zlib

import grpc

from pdserve.defaults import KV_EVENTS_MAX_MESSAGE_BYTES
from pdserve.kv_follow import follow
from pdserve.kv_index import PrefixIndex
from pdserve.protos import generate_pb2_grpc as gpb_grpc
from pdserve.protos import kv_events_pb2 as kpb
from pdserve.protos import kv_events_pb2_grpc as kpb_grpc
from pdserve.tls import TlsFiles, aio_channel


RETIRE_GRACE_S = 600.0  # after a certificate rotation: how long the old channel's relays may still run


def poll_phase(address: str) -> float:
    """The part of the load-poll interval, in [0, 1), a prefill's watch waits after its first poll (by its
    address: the same every run, spread over the prefills)."""
    return (zlib.crc32(address.encode()) % 1024) / 1024


class PrefillWatch:
    def __init__(self, address: str, index: PrefixIndex, metrics=None, name: str = "router",
                 interval_s: float = 0.2, expiry_s: float = 1.5, tls: TlsFiles | None = None):
        self.address, self.index, self.metrics, self.name = address, index, metrics, name
        self.interval_s, self.expiry_s = interval_s, expiry_s
        self.host = address.rpartition(":")[0]
        self.load: kpb.ServerLoad | None = None
        self.load_at = 0.0
        self.in_flight = 0  # requests this router is relaying to it now
        self.pushed = True  # its load comes on a WatchLoad stream (False: an older prefill, polled)
        self.tls = tls  # mutual TLS (pdserve/tls.py); a rotation gets a new channel (_renew_if_rotated)
        self._tasks: list[asyncio.Task] = []
        self._retiring: set[asyncio.Task] = set()  # old channels closing once their relays end
        self._open_channel()

    def _open_channel(self) -> None:
        # a snapshot of every block the prefill holds is one message
        options = [("grpc.max_receive_message_length", KV_EVENTS_MAX_MESSAGE_BYTES)]
        self._stamp = self.tls.stamp() if self.tls is not None else None
        self._channel = aio_channel(self.address, self.tls, options)
        self._stub = kpb_grpc.KvEventsStub(self._channel)
        self.generator = gpb_grpc.GeneratorStub(self._channel)  # the router's gRPC Generate relays on it

    # ---- what the router reads ---------------------------------------------------------------
    def routable(self) -> bool:
        load = self.load
        return (load is not None and load.ready and load.http_port > 0
                and time.monotonic() - self.load_at <= self.expiry_s)

    @property
    def http_url(self) -> str:
        """Its HTTP address, from its load report (a routable prefill has one)."""
        if self.load is None:
            raise RuntimeError(f"prefill {self.address} has sent no load report yet: its HTTP port is unknown")
        return f"http://{self.host}:{self.load.http_port}"

    def state(self) -> dict:
        view = self.index.view(self.address)
        load = self.load
        return {
            "routable": self.routable(), "in_flight_here": self.in_flight,
            "load": None if load is None else {"ready": load.ready, "reason": load.not_ready_reason,
                                               "in_flight": load.in_flight, "queued": load.queued,
                                               "kv_blocks_free": load.kv_blocks_free,
                                               "epoch": load.epoch, "http_port": load.http_port},
            "index": None if view is None else {"epoch": view.epoch, "seq": view.seq, "synced": view.synced,
                                                "blocks": len(view.hashes), "block_size": view.block_size},
        }

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._events(), name=f"kv-events {self.address}"),
                       asyncio.create_task(self._load(), name=f"load {self.address}")]

    async def stop(self, grace: float | None = None) -> None:
        """Stop watching; ``grace``: seconds the channel's calls still running (gRPC Generate
        relays) may take before they are cancelled (None: at once)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self._channel.close(grace)
        for task in list(self._retiring):
            task.cancel()

    def _renew_if_rotated(self) -> bool:
        """When the TLS files were rotated since the channel was made: a new channel (and KV-event stream:
        the index resyncs this prefill) for what comes next; the old one closes once its relays end (up to
        RETIRE_GRACE_S). Returns whether it renewed."""
        if self.tls is None or self.tls.stamp() == self._stamp:
            return False
        old = self._channel
        self._open_channel()
        task = asyncio.create_task(old.close(RETIRE_GRACE_S))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        if self._tasks:  # started: follow the events on the new channel
            self._tasks[0].cancel()
            self._tasks[0] = asyncio.create_task(self._events(), name=f"kv-events {self.address}")
        return True

    # ---- the two tasks -------------------------------------------------------------------------
    def _count(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.router_index_resyncs.labels(prefill=self.address, reason=reason).inc()

    async def _events(self) -> None:
        try:
            await follow(self._stub, self.address, self.index, self.name, on_sync=self._count)
        finally:
            self._publish_size()

    def _publish_size(self) -> None:
        if self.metrics is not None:
            view = self.index.view(self.address)
            self.metrics.router_index_blocks.labels(prefill=self.address).set(len(view.hashes) if view else 0)

    @property
    def _silence_s(self) -> float:
        """How long a load poll may take, or a load stream be silent, before the prefill is unroutable."""
        return max(1.0, self.interval_s * 5)

    async def _load(self) -> None:
        """Load reports: pushed on one stream (``WatchLoad``) while the prefill speaks it, else polled (``GetLoad``)."""
        pause = self.interval_s * poll_phase(self.address)  # then interval_s: the polls spread (module doc)
        while True:
            self._renew_if_rotated()
            if self.pushed:
                if await self._watch_load():
                    continue  # again at once: on the renewed channel, or polled
            else:
                try:
                    self.load = await self._stub.GetLoad(kpb.LoadRequest(), timeout=self._silence_s)
                    self.load_at = time.monotonic()
                except grpc.aio.AioRpcError:
                    self.load = None
            self._publish_size()
            await asyncio.sleep(pause)
            pause = self.interval_s

    async def _watch_load(self) -> bool:
        """The prefill's WatchLoad stream into ``load`` until it ends, breaks or is silent for ``_silence_s``: then
        the load is None (unroutable at once, as after a failed poll) and False (open it again after a pause).
        True: at once again, after a TLS rotation (a new channel; the last report still counts) or on a prefill
        that has no WatchLoad (an older server: polled from now on, ``pushed`` False)."""
        call = self._stub.WatchLoad(kpb.LoadRequest(interval_ms=max(1, round(self.interval_s * 1000))))
        try:
            async with asyncio.timeout(self._silence_s) as silence:
                async for load in call:
                    self.load, self.load_at = load, time.monotonic()
                    self._publish_size()
                    if self._renew_if_rotated():
                        return True
                    silence.reschedule(asyncio.get_running_loop().time() + self._silence_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.pushed, self.load = False, None
                return True
        except TimeoutError:
            pass
        finally:
            call.cancel()
        self.load = None
        return False
