"""LoadReportPoller: asks every known decode for its load report every ``interval_s``.

It keeps one gRPC channel per decode address (shared with the Session streams, see
``channel``), follows discovery and feeds each answer to the DecodePicker. A new address
gets a channel. A vanished one is forgotten by the picker at once (no new request goes
there) and its channel is closed with a grace of ``close_grace_s``: Sessions still open on
it finish first (a draining decode leaves discovery while it serves them; closing at once
would cut them off); the ones still open when the grace ends (``--decode-leave-grace``) fail
with DecodeFailed and resume elsewhere (decode_session.py). A decode that does not answer simply stops being updated; the picker
lets its last report expire. With a ``DecodeIndex`` it also keeps one KV-event stream per
discovered decode (on the same channel): a new decode is followed from the round it appears
in, a vanished one is dropped from the index before its channel closes.

``poll_now(address)`` asks one decode at once (a request there just ended and others wait
for blocks); ``on_report(address)``, when given, is called after each answer reached the picker.
"""  # noqa: E501

from __future__ import annotations

import asyncio
import logging
import math
from typing import Callable

import grpc

from pdserve.defaults import REQUEST_TIMEOUT_S
from pdserve.protos import session_pb2 as pb
from pdserve.tls import TlsFiles, aio_channel
from pdserve.protos import session_pb2_grpc as pb_grpc

from .picker import DecodeLoad, DecodePicker

log = logging.getLogger(__name__)

# Detect a dead decode on an idle channel quickly; loopback and cluster networks allow it.
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # A decode restarted on the same address is routable again within about a second: gRPC's
    # default reconnect backoff grows to 120 s, and grew to 20-30 s in `pdserve bench chaos`.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]


class LoadReportPoller:
    def __init__(self, discovery, picker: DecodePicker, interval_s: float = 0.3, on_update=None, index=None,
                 close_grace_s: float = REQUEST_TIMEOUT_S, on_report: Callable[[str], None] | None = None,
                 tls: TlsFiles | None = None):
        if interval_s <= 0:
            raise ValueError(f"load report interval must be > 0, got {interval_s}")
        self.discovery, self.picker, self.interval_s = discovery, picker, interval_s
        self.close_grace_s = close_grace_s
        self._leaving: dict[asyncio.Task, grpc.aio.Channel] = {}  # channels of vanished decodes, closing gracefully
        # Reports expire by missed rounds as well as by age (see DecodePicker.stale_rounds).
        picker.stale_rounds = max(2, math.ceil(picker.expiry_s / interval_s))
        self.on_update = on_update
        self.on_report = on_report  # the prefill's admission queue: a fresh report may show freed blocks
        self.index = index  # a DecodeIndex (decode_index.py), or None: no prefix knowledge
        self.tls = tls  # mutual TLS on every channel (pdserve/tls.py; a rotation gets a new channel: channel())
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stamps: dict[str, tuple | None] = {}  # the TLS files' reading each channel was made under
        self._task: asyncio.Task | None = None
        self._inflight: dict[str, asyncio.Task] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        """The channel to ``address``; a new one when the TLS files were rotated since it was made (the old
        one's open calls, Session streams included, finish within ``close_grace_s``)."""
        stamp = self.tls.stamp() if self.tls is not None else None
        ch = self._channels.get(address)
        if ch is not None and self._stamps.get(address) != stamp:
            self._retire(address)
            ch = None
        if ch is None:
            ch = self._channels[address] = aio_channel(address, self.tls, options=CHANNEL_OPTIONS)
            self._stamps[address] = stamp
        return ch

    def _retire(self, address: str) -> None:
        """Close ``address``'s channel gracefully in the background (no new call gets it)."""
        ch = self._channels.pop(address)
        self._stamps.pop(address, None)
        task = asyncio.create_task(ch.close(grace=self.close_grace_s))
        self._leaving[task] = ch
        task.add_done_callback(lambda t: self._leaving.pop(t, None))

    def stub(self, address: str) -> pb_grpc.DecodeStub:
        return pb_grpc.DecodeStub(self.channel(address))

    async def start(self) -> None:
        """Poll once (waiting for the answers, so a healthy decode is routable at once), then keep polling."""
        await self.poll_once(wait=True)
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for task in self._inflight.values():
            task.cancel()
        if self.index is not None:
            await self.index.stop()
        for task, ch in list(self._leaving.items()):
            task.cancel()
            await ch.close()  # no grace now: the server is stopping
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        self._stamps.clear()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.poll_once()
            except Exception:  # never let one bad round stop polling
                log.exception("load report round failed")

    async def poll_once(self, wait: bool = False) -> None:
        """Start a poll of every discovered decode that has none in flight (a slow or dead
        decode never delays the reports of the others); ``wait``: until they answer."""
        addresses = set(self.discovery.addresses())
        self.picker.round_started()
        if self.index is not None:
            self.index.reconcile(addresses, self.channel)
        for gone in set(self.picker.known()) - addresses:
            self.picker.forget(gone)
        for gone in set(self._channels) - addresses:
            self._retire(gone)
        started = []
        for address in sorted(addresses):
            polling = self._inflight.get(address)
            if polling is None or polling.done():
                task = self._inflight[address] = asyncio.create_task(self._poll(address))
                started.append(task)
        if wait and started:
            await asyncio.wait(started)
        if self.on_update:
            self.on_update()

    def poll_now(self, address: str) -> None:
        """Ask ``address`` for its load report now, unless a poll of it is already in flight."""
        task = self._inflight.get(address)
        if (self._task is not None and not self._task.done() and address in self._channels
                and (task is None or task.done())):
            self._inflight[address] = asyncio.create_task(self._poll(address))

    async def _poll(self, address: str) -> None:
        try:
            report = await self.stub(address).GetLoadReport(pb.LoadReportRequest(),
                                                            timeout=max(1.0, self.interval_s * 3))
        except grpc.aio.AioRpcError as exc:
            log.debug("load report from %s failed: %s", address, exc.code())
            return
        self.picker.update(
            address,
            DecodeLoad(
                free_blocks=report.free_blocks,
                free_bytes=report.free_bytes,
                total_blocks=report.total_blocks,
                protocol_version=report.protocol_version,
                draining=report.draining,
                running=report.running,
                waiting=report.waiting,
                prefill_tokens_per_s=report.prefill_tokens_per_s,
                pool_free_blocks=report.pool_free_blocks,
                pool_total_blocks=report.pool_total_blocks,
            ),
        )
        if self.on_report is not None:
            self.on_report(address)
