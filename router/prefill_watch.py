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
2. **load** - ``KvEvents.GetLoad`` every ``interval_s``: in flight, free blocks, ready, and the
   port of its HTTP API. A failed poll makes the prefill unroutable at once; a report older
   than ``expiry_s`` does not count.

Both tasks run on the event loop, which owns the index: no locks.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from pdserve.defaults import KV_EVENTS_MAX_MESSAGE_BYTES
from pdserve.kv_follow import follow
from pdserve.kv_index import PrefixIndex
from pdserve.protos import generate_pb2_grpc as gpb_grpc
from pdserve.protos import kv_events_pb2 as kpb
from pdserve.protos import kv_events_pb2_grpc as kpb_grpc
from pdserve.tls import TlsFiles, aio_channel


RETIRE_GRACE_S = 600.0  # after a certificate rotation: how long the old channel's relays may still run


class PrefillWatch:
    def __init__(self, address: str, index: PrefixIndex, metrics=None, name: str = "router",
                 interval_s: float = 0.2, expiry_s: float = 1.5, tls: TlsFiles | None = None):
        self.address, self.index, self.metrics, self.name = address, index, metrics, name
        self.interval_s, self.expiry_s = interval_s, expiry_s
        self.host = address.rpartition(":")[0]
        self.load: kpb.ServerLoad | None = None
        self.load_at = 0.0
        self.in_flight = 0  # requests this router is relaying to it now
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
                       asyncio.create_task(self._poll_load(), name=f"load {self.address}")]

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

    async def _poll_load(self) -> None:
        while True:
            self._renew_if_rotated()
            try:
                self.load = await self._stub.GetLoad(kpb.LoadRequest(), timeout=max(1.0, self.interval_s * 5))
                self.load_at = time.monotonic()
            except grpc.aio.AioRpcError:
                self.load = None
            self._publish_size()
            await asyncio.sleep(self.interval_s)
