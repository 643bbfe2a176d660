"""The receiver's NIXL side: one thread turns NIXL notifications into arrivals.

Contract: each notification says the bytes of one WRITE have landed and names, for each
(request, layer) it carries, the destination blocks (``nixl_backend.decode_notif``). A
record for a request the ``EntryTable`` does not expect, or for blocks not allocated to it,
is counted as rejected and dropped (the bytes are already there: NIXL WRITEs are one-sided).

NIXL's Python API offers no blocking wait and agents run without NIXL's progress thread,
so this thread polls the agent, with a backoff up to 0.2 ms, while some entry still waits
for KV. With no entry waiting it still drives the agent every ``IDLE_PROGRESS_S`` while a
sender is connected: UCX completes a sender's WRITE (one for an entry deleted, failed or
never expected included) only once this side makes progress too, and a sender keeps
that WRITE's link slot until then. With no sender connected it sleeps (0.5 s, or until woken).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable

from .entries import EntryTable
from .errors import ProtocolError, UnknownRequestError
from .memory import KVLayout
from .nixl_backend import NixlMemory, decode_notif

log = logging.getLogger("pdserve.cachestore.receiver")
IDLE_PROGRESS_S = 0.005


class NixlReceiveLoop:
    def __init__(self, nixl: NixlMemory, table: EntryTable, layout: KVLayout, counters: dict,
                 on_arrived: Callable[[Iterable[str]], None], senders_connected: Callable[[], bool]):
        self.nixl, self.table, self.layout, self.counters = nixl, table, layout, counters
        self._on_arrived = on_arrived
        self._senders_connected = senders_connected
        self._wake = threading.Event()
        self._stopping = False
        self.thread = threading.Thread(target=self._run, name="cachestore-rx-nixl", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def wake(self) -> None:
        """An entry now waits for KV: poll at once."""
        self._wake.set()

    def stop(self) -> threading.Thread:
        self._stopping = True
        self._wake.set()
        return self.thread

    def _run(self) -> None:
        idle = 0
        while not self._stopping:
            waiting = self.table.incomplete > 0
            if not waiting:
                connected = self._senders_connected()
                self._wake.wait(IDLE_PROGRESS_S if connected else 0.5)
                self._wake.clear()
                if not connected:
                    continue
            notifs = self.nixl.agent.get_new_notifs()
            if not notifs:
                if waiting:
                    idle += 1
                    time.sleep(min(0.0002, 0.00001 * idle))
                continue
            idle = 0
            touched: set[str] = set()
            for msgs in notifs.values():
                for msg in msgs:
                    touched |= self._land(msg)
            self._on_arrived(touched)

    def _land(self, msg: bytes) -> set[str]:
        try:
            records = decode_notif(msg)
        except ProtocolError as exc:
            log.warning("dropped a NIXL notification: %s", exc)
            return set()
        touched: set[str] = set()
        for rid, layer, slices in records:
            for block, n in slices:
                try:
                    self.table.begin_receive(rid, layer, block, n)
                except (UnknownRequestError, ProtocolError) as exc:
                    self.counters["frames_rejected"] += 1
                    log.warning("NIXL write rejected: %s", exc)
                    continue
                touched |= self.table.end_receive(rid, layer, block, n, True)
                self.counters["bytes_received"] += n * self.layout.block_nbytes
                self.counters["frames_received"] += 1
        return touched
