"""DecodeIndex: which prompt blocks each decode's prefix cache holds, for the decode picker.

Each decode publishes its prefix cache on its gRPC port (``KvEvents``, the same stream
prefills publish for routers). Lifecycle, driven by the LoadReportPoller's rounds:

1. ``reconcile(addresses, channel_for)`` - a decode new to discovery gets a follow task
   (``pdserve/kv_follow.py``: snapshot, then events stamped with epoch + seq; a gap, a new
   epoch or a broken stream forgets its hashes at once and resubscribes); a decode gone from
   discovery has its task cancelled and its view dropped from the index at once.
2. ``overlap(address, prompt_hashes)`` - leading prompt blocks the decode holds, as far as
   its events say (0 while not synced). A hint for the picker only: the decode's Allocation
   says what it really reuses, and pins those blocks (decode_server/session.py).
3. ``stop()`` - cancel every task (at shutdown).

The index bound (docs/design.md): a decode's view is its published set as of some seq, or empty.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from pdserve.kv_follow import follow
from pdserve.kv_index import PrefixIndex
from pdserve.protos import kv_events_pb2_grpc as kpb_grpc


class DecodeIndex:
    def __init__(self, subscriber: str = "prefill"):
        self.index = PrefixIndex()
        self.subscriber = subscriber
        self._tasks: dict[str, asyncio.Task] = {}

    def reconcile(self, addresses, channel_for: Callable[[str], object]) -> None:
        addresses = set(addresses)
        for gone in set(self._tasks) - addresses:
            self._tasks.pop(gone).cancel()
            self.index.remove(gone)
        for address in sorted(addresses - set(self._tasks)):
            stub = kpb_grpc.KvEventsStub(channel_for(address))
            self._tasks[address] = asyncio.create_task(follow(stub, address, self.index, self.subscriber),
                                                       name=f"decode kv events {address}")

    def overlap(self, address: str, prompt_hashes: list[int]) -> int:
        return self.index.overlap(address, prompt_hashes)

    def state(self) -> dict:
        """For /health: per decode, whether its view is synced and how many blocks it holds."""
        out = {}
        for address in self.index.servers():
            view = self.index.view(address)
            if view is None:  # forgotten between the two reads
                continue
            out[address] = {"synced": view.synced, "blocks": len(view.hashes), "seq": view.seq}
        return out

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
