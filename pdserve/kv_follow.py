"""follow(): keep one server's view in a PrefixIndex from its KV-event stream (the receiving end
of ``pdserve/kv_events.py``; the protocol is in ``protos/kv_events.proto``).

Lifecycle of one follow task (it runs until cancelled):

1. **subscribe** - ``KvEvents.Subscribe``; the stream's first event is a SNAPSHOT, applied with
   ``index.apply_snapshot``. A snapshot of another KV_EVENTS_VERSION is not used: the server's
   view stays empty (callers then choose by load alone).
2. **events** - each event goes to ``index.apply_event``. A verdict of gap / epoch / unsynced
   has already forgotten the server's hashes; the stream is cancelled and step 1 runs again at
   once (the new stream starts with a snapshot).
3. **broken** - the stream fails or ends (the server died or restarted): the server's hashes
   are forgotten at once, then step 1 after a backoff (0.1 s doubling to 2 s).

``on_sync(reason)`` hears every snapshot reason (initial|epoch|resync) and every distrust
(gap|epoch|unsynced|disconnected), for metrics and logs. The index is owned by the event loop
this runs on: no locks. Followers: the prefill's index of its decodes, the router's
``PrefillWatch`` (of its prefills).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import grpc

from pdserve.kv_index import CLEARED, REMOVED, RESYNC_VERDICTS, STORED, PrefixIndex
from pdserve.protos import kv_events_pb2 as kpb
from pdserve.protos.version import KV_EVENTS_VERSION

log = logging.getLogger(__name__)
KINDS = {kpb.KvEvent.BLOCK_STORED: STORED, kpb.KvEvent.BLOCK_REMOVED: REMOVED, kpb.KvEvent.ALL_CLEARED: CLEARED}


class _Resubscribe(Exception):
    pass


async def follow(stub, server: str, index: PrefixIndex, subscriber: str,
                 on_sync: Callable[[str], None] | None = None) -> None:
    """Follow ``server``'s KvEvents stream (``stub``: a KvEventsStub) into ``index`` until cancelled."""
    note = on_sync or (lambda reason: None)
    backoff = 0.1
    while True:
        stream = stub.Subscribe(kpb.SubscribeRequest(subscriber=subscriber))
        why = "stream ended"
        try:
            async for batch in stream:
                for ev in batch.events:
                    _apply(ev, server, index, note)
                backoff = 0.1
        except _Resubscribe:
            stream.cancel()
            continue
        except grpc.aio.AioRpcError as exc:
            why = exc.code().name
        view = index.view(server)
        if view is not None and view.synced:
            log.info("kv events of %s: %s; its index entries are dropped", server, why)
            note("disconnected")
        index.forget(server)
        await asyncio.sleep(backoff)
        backoff = min(2 * backoff, 2.0)


def _apply(ev, server: str, index: PrefixIndex, note: Callable[[str], None]) -> None:
    if ev.kind == kpb.KvEvent.SNAPSHOT:
        if ev.version != KV_EVENTS_VERSION:
            log.error("%s publishes KV events version %d, ours is %d: its prefix cache is not used",
                      server, ev.version, KV_EVENTS_VERSION)
            index.forget(server)
            return
        reason = index.apply_snapshot(server, ev.epoch, ev.seq, ev.block_hashes, ev.block_size)
        log.debug("kv events of %s: snapshot (%s) epoch %s seq %d, %d blocks", server, reason, ev.epoch[:8], ev.seq,
                  len(ev.block_hashes))
        note(reason)
        return
    verdict = index.apply_event(server, ev.epoch, ev.seq, KINDS[ev.kind], ev.block_hashes)
    if verdict in RESYNC_VERDICTS:
        log.warning("kv events of %s: %s at seq %d; resubscribing for a snapshot", server, verdict, ev.seq)
        note(verdict)
        raise _Resubscribe()
