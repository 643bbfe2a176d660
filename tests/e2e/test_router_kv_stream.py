"""The KV-event stream over real gRPC, in one process: a KvEventsServicer on a loopback port
and the router's PrefillWatch/PrefillSet subscribed to it.

- the index follows the publisher's set;
- events dropped for a slow subscriber (a sequence gap) -> resubscribe -> the index equals the
  publisher's set again (metric reason "gap", then a "resync" snapshot);
- the server restarts on the same port with a new publisher (new epoch) -> the index is
  forgotten while it is down and resynced from the new snapshot (reason "epoch");
- a prefill gone from discovery leaves the index at once;
- afterwards the publisher has no subscriber left.
"""

import asyncio
import time

import grpc

from pdserve.kv_events import KvEventPublisher, KvEventsServicer
from pdserve.metrics import ServerMetrics
from pdserve.net import free_port
from pdserve.protos import kv_events_pb2 as kpb
from pdserve.protos import kv_events_pb2_grpc as kpb_grpc
from pdserve.kv_index import PrefixIndex
from pdserve.router.prefills import PrefillSet


class Discovery:
    """Discovery whose address list the test changes (StaticDiscovery's never changes)."""

    def __init__(self, addresses):
        self.list = list(addresses)

    def addresses(self):
        return list(self.list)

    async def start(self):
        pass

    async def stop(self):
        pass


async def serve(port: int, pub: KvEventPublisher):
    server = grpc.aio.server()
    load = lambda: kpb.ServerLoad(ready=True, in_flight=0, kv_blocks_free=64, kv_blocks_total=64, http_port=1)  # noqa: E731
    kpb_grpc.add_KvEventsServicer_to_server(KvEventsServicer(pub, load), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


async def until(cond, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def resyncs(m: ServerMetrics, address: str, reason: str) -> float:
    v = m.registry.get_sample_value("pdserve_router_index_resyncs_total",
                                    {"role": "router", "pool": "default", "inference_service": "local",
                                     "prefill": address, "reason": reason})
    return v or 0.0


def test_stream_gap_restart_and_removal():
    async def main():
        port = free_port()
        address = f"127.0.0.1:{port}"
        pub = KvEventPublisher(block_size=16, max_pending=3)
        pub.stored([1, 2, 3])
        server = await serve(port, pub)
        m, index = ServerMetrics(role="router"), PrefixIndex()
        discovery = Discovery([address])
        prefills = PrefillSet(discovery, index, m, interval_s=0.05, load_interval_s=0.05)
        await prefills.start()
        try:
            view = lambda: index.view(address)  # noqa: E731
            synced_to = lambda p: lambda: view() is not None and view().synced and view().hashes == set(p.snapshot()[1])  # noqa: E731
            await until(synced_to(pub), "the first snapshot")
            assert resyncs(m, address, "initial") == 1
            await until(lambda: prefills.routable(), "a load report")
            pub.stored([4])
            pub.removed([1])
            await until(lambda: view().hashes == {2, 3, 4}, "two events")

            # a burst while the loop is busy: only max_pending fit, the rest are dropped -> gap
            before = pub.snapshot()[0]
            for h in range(100, 110):
                pub.stored([h])
            # the max_pending (3) events that fit reach the subscriber; the 7 dropped after them are a gap it
            # cannot see yet. Once it has taken those 3, the next event is queued again and reveals the gap.
            await until(lambda: view().seq == before + 3, "the events that fit the subscriber's queue")
            assert {100, 101, 102} <= view().hashes and 103 not in view().hashes
            pub.stored([999])  # the next event reveals the gap
            await until(lambda: resyncs(m, address, "gap") == 1, "the gap to be seen")
            await until(synced_to(pub), "the resync after the gap")
            assert resyncs(m, address, "resync") == 1
            assert view().epoch == pub.epoch and view().seq == pub.snapshot()[0]

            # restart: the server goes away (index forgotten), comes back with a new epoch
            await server.stop(grace=None)
            await until(lambda: not view().synced, "the broken stream to be noticed")
            assert view().hashes == set() and index.overlap(address, [2]) == 0
            pub2 = KvEventPublisher(block_size=16)
            pub2.stored([7, 8])
            server = await serve(port, pub2)
            await until(synced_to(pub2), "the snapshot of the new epoch")
            assert view().epoch == pub2.epoch != pub.epoch
            assert resyncs(m, address, "epoch") == 1

            # gone from discovery: out of the index at once (one reconcile), stream closed
            discovery.list = []
            await prefills.reconcile()
            assert index.view(address) is None and address not in prefills.watches
            await until(lambda: pub2.num_subscribers() == 0, "the subscription to end")
        finally:
            await prefills.stop()
            await server.stop(grace=None)
        assert pub.num_subscribers() == 0 and pub2.num_subscribers() == 0

    asyncio.run(main())
