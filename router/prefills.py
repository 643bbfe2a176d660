"""PrefillSet: the prefills discovery names, each watched by a PrefillWatch.

``reconcile()`` (every ``interval_s``, and once at start) compares discovery's addresses with
the watched ones: a new address gets a PrefillWatch; an address gone from discovery leaves the
index at once (before its watch is stopped), so no request is routed on its entries again.
Its channel closes with a grace of ``close_grace_s`` (the request timeout): gRPC Generate relays
still running on it (a prefill draining after a scale-down) finish instead of being cut.
Discovery is ``pdserve.discovery`` (``--prefill host:port,...`` or Kubernetes EndpointSlices
of the prefill Services, port named "grpc").
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.defaults import REQUEST_TIMEOUT_S
from pdserve.kv_index import PrefixIndex
from pdserve.tls import TlsFiles

from .prefill_watch import PrefillWatch

log = logging.getLogger(__name__)


class PrefillSet:
    def __init__(self, discovery, index: PrefixIndex, metrics=None, name: str = "router", interval_s: float = 0.2,
                 load_interval_s: float = 0.2, load_expiry_s: float = 1.5, close_grace_s: float = REQUEST_TIMEOUT_S,
                 tls: TlsFiles | None = None):
        self.discovery, self.index, self.metrics, self.name = discovery, index, metrics, name
        self.interval_s, self.load_interval_s, self.load_expiry_s = interval_s, load_interval_s, load_expiry_s
        self.close_grace_s = close_grace_s
        self.tls = tls  # mutual TLS to the prefills' gRPC ports (pdserve/tls.py); None: plain
        self.watches: dict[str, PrefillWatch] = {}
        self._leaving: dict[asyncio.Task, PrefillWatch] = {}  # watches of departed prefills, closing gracefully
        self._task: asyncio.Task | None = None

    def routable(self) -> list[PrefillWatch]:
        return [w for _, w in sorted(self.watches.items()) if w.routable()]

    async def reconcile(self) -> None:
        want = set(self.discovery.addresses())
        for address in sorted(set(self.watches) - want):
            log.info("prefill %s left discovery: dropped from the index", address)
            self.index.remove(address)
            watch = self.watches.pop(address)
            task = asyncio.create_task(watch.stop(grace=self.close_grace_s), name=f"closing {address}")
            self._leaving[task] = watch
            task.add_done_callback(lambda t: self._leaving.pop(t, None))
            if self.metrics is not None:
                self.metrics.router_index_blocks.labels(prefill=address).set(0)
        for address in sorted(want - set(self.watches)):
            log.info("prefill %s joined", address)
            watch = PrefillWatch(address, self.index, self.metrics, self.name, self.load_interval_s, self.load_expiry_s,
                                 tls=self.tls)
            self.watches[address] = watch
            await watch.start()
        if self.metrics is not None:
            self.metrics.router_routable_prefills.set(len(self.routable()))

    async def start(self) -> None:
        await self.discovery.start()
        await self.reconcile()
        self._task = asyncio.create_task(self._loop(), name="prefill discovery")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.reconcile()
            except Exception:  # noqa: BLE001 - keep watching; the next tick retries
                log.exception("reconciling prefills failed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for task, watch in list(self._leaving.items()):
            task.cancel()
            await watch.stop()  # no grace now: the router is stopping
        for watch in self.watches.values():
            await watch.stop()
        self.watches.clear()
        await self.discovery.stop()
