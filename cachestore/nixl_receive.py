"""The receiver's NIXL side: one thread turns NIXL notifications into arrivals.

Contract: each notification says the bytes of one WRITE have landed and names, for each
(request, layer) it carries, the destination blocks (``nixl_backend.decode_notif``). A
record for a request the ``EntryTable`` does not expect, or for blocks not allocated to it,
is counted as rejected (a wrong bind token: in ``binds_refused``) and dropped (the bytes are
already there: NIXL WRITEs are one-sided). When the notification carries checksums, each slice's
bytes are summed in the destination blocks before they count as arrived; a mismatch is reported to
the receiver (``on_corrupt``), which fails the entry (``checksum.py``). The checks are
``landing.land``, shared with the same-node path's WRITTEN frames.

NIXL's Python API offers no blocking wait and agents run without NIXL's progress thread,
so this thread polls the agent while some entry still waits for KV: every ``POLL_S``
(0.2 ms) for ``FAST_WINDOW_S`` after a notification (a stream of WRITEs), then every
``POLL_MAX_S`` (2 ms) until the next one (a prefill computing its next layer). With
no entry waiting it still drives the agent every ``IDLE_PROGRESS_S`` while a sender is
connected: UCX completes a sender's WRITE (one for an entry deleted, failed or never
expected included) only once this side makes progress too, and a sender keeps that
WRITE's link slot until then. With no sender connected it sleeps (0.5 s, or until woken).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable

from .entries import EntryTable
from .errors import ChecksumError, ProtocolError
from .landing import land
from .memory import KVLayout
from .nixl_backend import NixlMemory, decode_notif
from .wire_io import RegionIO

log = logging.getLogger("pdserve.cachestore.receiver")
IDLE_PROGRESS_S = 0.005
# Between two polls while some entry waits for KV: POLL_S within FAST_WINDOW_S of the last
# notification, POLL_MAX_S after. A backoff from 10 us polled half again as often (0.065 s of
# receiver CPU per 512 MiB instead of 0.041 s, `pdserve bench cachestore`) for at most 0.2 ms
# sooner news of a layer; polling every POLL_S throughout, a decode polled 5,000 times a second
# for as long as some prefill computed a prompt for it, on the core its decode steps run on;
# backing off at once, the sender's WRITEs of a stream waited for this side's progress (bulk
# throughput 79-92% of one raw WRITE instead of 97-102%).
POLL_S = 0.0002
POLL_MAX_S = 0.002
FAST_WINDOW_S = 0.005


class NixlReceiveLoop:
    def __init__(self, nixl: NixlMemory, table: EntryTable, layout: KVLayout, counters: dict,
                 on_arrived: Callable[[Iterable[str]], None], senders_connected: Callable[[], bool],
                 on_corrupt: Callable[[ChecksumError], None]):
        self.nixl, self.table, self.layout, self.counters = nixl, table, layout, counters
        self._on_arrived = on_arrived
        self._on_corrupt = on_corrupt
        self._io = RegionIO(nixl.region)
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
        last_notif = 0.0
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
                    time.sleep(POLL_S if time.monotonic() - last_notif < FAST_WINDOW_S else POLL_MAX_S)
                continue
            last_notif = time.monotonic()
            touched: set[str] = set()
            for msgs in notifs.values():
                for msg in msgs:
                    touched |= self._land(msg)
            self._on_arrived(touched)

    def _land(self, msg: bytes) -> set[str]:
        try:
            checksummed, records = decode_notif(msg)
        except ProtocolError as exc:
            log.warning("dropped a NIXL notification: %s", exc)
            return set()
        out = land(records, checksummed, self.table, self.layout, self._io, self.counters)  # landing.py
        for _, why in out.refused:
            log.warning("NIXL write rejected: %s", why)
        for bad in out.corrupt:
            self._on_corrupt(bad)
        return out.touched
