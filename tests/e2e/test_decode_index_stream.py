"""The prefill's DecodeIndex over real gRPC, in one process: a KvEventsServicer (what a decode
serves on its gRPC port) on a loopback port, followed by ``pdserve/kv_follow.py``.

- the index follows the publisher's set (snapshot, then events);
- events dropped for a slow subscriber (a sequence gap) -> resubscribe -> the set again;
- the server restarts with a new publisher (new epoch): forgotten while it is down, then resynced;
- a decode gone from discovery (reconcile) leaves the index at once and its stream ends.
"""

import asyncio
import time

import grpc

from pdserve.kv_events import KvEventPublisher, KvEventsServicer
from pdserve.net import free_port
from pdserve.prefill_server.decode_index import DecodeIndex
from pdserve.prefill_server.load_poller import CHANNEL_OPTIONS
from pdserve.protos import kv_events_pb2 as kpb
from pdserve.protos import kv_events_pb2_grpc as kpb_grpc


async def serve(port: int, pub: KvEventPublisher):
    server = grpc.aio.server()
    kpb_grpc.add_KvEventsServicer_to_server(KvEventsServicer(pub, lambda: kpb.ServerLoad(ready=True)), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


async def until(cond, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def test_decode_index_follows_gaps_restarts_and_removal():
    async def main():
        port = free_port()
        address = f"127.0.0.1:{port}"
        pub = KvEventPublisher(block_size=16, max_pending=3)
        pub.stored([1, 2, 3])
        server = await serve(port, pub)
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        index = DecodeIndex(subscriber="test")
        index.reconcile([address], lambda a: channel)
        view = lambda: index.index.view(address)  # noqa: E731
        synced_to = lambda p: lambda: (view() is not None and view().synced  # noqa: E731
                                       and view().hashes == set(p.snapshot()[1]))
        try:
            await until(synced_to(pub), "the first snapshot")
            assert index.overlap(address, [1, 2, 9, 3]) == 2
            pub.stored([4])
            pub.removed([1])
            await until(lambda: view().hashes == {2, 3, 4}, "two events")
            assert index.overlap(address, [1, 2]) == 0

            before = pub.snapshot()[0]
            for h in range(100, 110):  # a burst beyond max_pending while the loop is busy: a gap
                pub.stored([h])
            # the max_pending (3) events that fit reach the subscriber; the 7 dropped after them are a gap it
            # cannot see yet. Once it has taken those 3, the next event is queued again and reveals the gap.
            await until(lambda: view().seq == before + 3, "the events that fit the subscriber's queue")
            assert {100, 101, 102} <= view().hashes and 103 not in view().hashes
            pub.stored([999])  # the next event reveals the gap
            await until(synced_to(pub), "the resync after the gap")
            assert view().seq == pub.snapshot()[0] and 999 in view().hashes

            await server.stop(grace=None)  # restart: forgotten while down, a new epoch after
            await until(lambda: not view().synced, "the broken stream to be noticed")
            assert index.overlap(address, [2]) == 0
            pub2 = KvEventPublisher(block_size=16)
            pub2.stored([7, 8])
            server = await serve(port, pub2)
            await until(synced_to(pub2), "the snapshot of the new epoch", timeout=15)
            assert view().epoch == pub2.epoch != pub.epoch
            assert index.state()[address] == {"synced": True, "blocks": 2, "seq": pub2.snapshot()[0]}

            index.reconcile([], lambda a: channel)  # gone from discovery: out at once, stream closed
            assert index.index.view(address) is None and index.overlap(address, [7]) == 0
            await until(lambda: pub2.num_subscribers() == 0, "the subscription to end")
        finally:
            await index.stop()
            await channel.close()
            await server.stop(grace=None)
        assert pub.num_subscribers() == 0 and pub2.num_subscribers() == 0

    asyncio.run(main())
