"""A prefill's load as the router's ``PrefillWatch`` gets it: pushed on one ``WatchLoad`` stream (pdserve's own
``KvEventsServicer`` over a real grpc.aio server), polled with ``GetLoad`` from a prefill without that stream (an
older server: UNIMPLEMENTED), unroutable at once when the stream breaks; and the polls spread over the interval:
the first report of every watch is asked at once, the pause after it is ``poll_phase`` of the interval (by
address), so watches started together report apart from then on instead of in one burst."""

import asyncio
import time

import grpc

from harness.conditions import until
from pdserve.kv_events import KvEventPublisher, KvEventsServicer
from pdserve.kv_index import PrefixIndex
from pdserve.net import free_port
from pdserve.protos import kv_events_pb2 as kpb
from pdserve.protos import kv_events_pb2_grpc as kpb_grpc
from pdserve.router.prefill_watch import PrefillWatch, poll_phase


def test_the_phases_of_64_prefills_cover_the_interval():
    phases = sorted(poll_phase(f"10.0.0.{i}:50051") for i in range(64))
    ports = sorted(poll_phase(f"127.0.0.1:{40000 + i}") for i in range(64))
    for ps in (phases, ports):
        assert all(0.0 <= p < 1.0 for p in ps)
        gaps = [b - a for a, b in zip(ps, ps[1:])] + [ps[0] + 1.0 - ps[-1]]
        assert max(gaps) < 0.25, gaps  # no quarter of the interval without a poll
        assert len(set(ps)) > 48  # a few may share a phase; most do not
    assert poll_phase("127.0.0.1:40000") == poll_phase("127.0.0.1:40000")  # the same every run


class Stub:
    """GetLoad answered at once; each call's time noted."""

    def __init__(self):
        self.calls: list[float] = []

    async def GetLoad(self, request, timeout=None):
        self.calls.append(time.monotonic())
        return kpb.ServerLoad(ready=True, http_port=1, kv_blocks_free=1, kv_blocks_total=1, block_size=16)


def test_watches_started_together_poll_once_at_once_then_in_the_order_of_their_phases():
    async def main():
        addresses: list[str] = []
        for i in range(400):  # addresses whose phases lie at least 1/16 of the interval apart (and from 0)
            a = f"127.0.0.1:{41000 + i}"
            if poll_phase(a) > 0.1 and all(abs(poll_phase(a) - poll_phase(b)) > 1 / 16 for b in addresses):
                addresses.append(a)
            if len(addresses) == 6:
                break
        watches = [PrefillWatch(a, PrefixIndex(), interval_s=0.4) for a in addresses]
        stubs = []
        for w in watches:
            w.pushed = False  # polled (an older prefill)
            w._stub = Stub()
            stubs.append(w._stub)
        tasks = [asyncio.create_task(w._load()) for w in watches]
        try:
            await until(lambda: all(len(s.calls) >= 1 for s in stubs), "every watch polled once")
            assert all(w.routable() for w in watches)
            await until(lambda: all(len(s.calls) >= 2 for s in stubs), "every watch polled twice")
            assert max(s.calls[0] for s in stubs) < min(s.calls[1] for s in stubs)
            by_second = sorted(range(len(watches)), key=lambda k: stubs[k].calls[1])
            assert by_second == sorted(range(len(watches)), key=lambda k: poll_phase(addresses[k]))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for w in watches:
                await w.stop()

    asyncio.run(main())


class Prefill:
    """KvEvents over grpc.aio with a load set by the test; ``servicer`` picks what it answers."""

    def __init__(self, servicer_class=KvEventsServicer):
        self.in_flight = 0
        self.servicer = servicer_class(KvEventPublisher(block_size=16), self.load)
        self.port = free_port()

    def load(self) -> kpb.ServerLoad:
        return kpb.ServerLoad(ready=True, in_flight=self.in_flight, kv_blocks_free=10, kv_blocks_total=10,
                              http_port=1)

    async def start(self) -> None:
        self.server = grpc.aio.server()
        kpb_grpc.add_KvEventsServicer_to_server(self.servicer, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()


class PushOnly(KvEventsServicer):
    """GetLoad refused: a watch that is routable here reads the pushed stream."""

    async def GetLoad(self, request, context):
        self.polled = True
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this prefill is not polled in this test")


class PollOnly(KvEventsServicer):
    """A prefill from before WatchLoad: the stream is UNIMPLEMENTED."""

    async def WatchLoad(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        yield  # an async generator, as a streaming handler is


def watch_of(prefill: Prefill) -> PrefillWatch:
    return PrefillWatch(f"127.0.0.1:{prefill.port}", PrefixIndex(), interval_s=0.05)


def test_the_load_is_pushed_on_one_stream_and_follows_the_prefill():
    async def main():
        prefill = Prefill(PushOnly)
        await prefill.start()
        watch = watch_of(prefill)
        task = asyncio.create_task(watch._load())
        try:
            await until(watch.routable, "the pushed load makes the prefill routable")
            prefill.in_flight = 7
            await until(lambda: watch.load is not None and watch.load.in_flight == 7, "the next push shows 7")
            assert watch.pushed and not getattr(prefill.servicer, "polled", False)
            assert watch.load.block_size == 16 and watch.load.epoch == prefill.servicer.publisher.epoch
            await prefill.server.stop(None)  # the prefill goes away: unroutable at once, not at the expiry
            await until(lambda: watch.load is None, "the broken stream drops the load")
            assert not watch.routable()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await watch.stop()
            await prefill.server.stop(None)

    asyncio.run(main())


def test_a_prefill_without_the_stream_is_polled():
    async def main():
        prefill = Prefill(PollOnly)
        await prefill.start()
        watch = watch_of(prefill)
        task = asyncio.create_task(watch._load())
        try:
            await until(watch.routable, "the polled load makes the prefill routable")
            assert not watch.pushed
            prefill.in_flight = 3
            await until(lambda: watch.load is not None and watch.load.in_flight == 3, "the next poll shows 3")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await watch.stop()
            await prefill.server.stop(None)

    asyncio.run(main())


class Silent(KvEventsServicer):
    """One report, then nothing (a hung prefill whose connection stays up)."""

    opened: list[float] = []

    async def WatchLoad(self, request, context):
        self.opened.append(time.monotonic())
        yield self.load()
        await asyncio.Event().wait()


def test_a_silent_stream_drops_the_load_after_a_polls_timeout():
    async def main():
        prefill = Prefill(Silent)
        await prefill.start()
        watch = watch_of(prefill)  # interval 0.05 s: a poll's timeout (and the silence allowed) is 1 s
        task = asyncio.create_task(watch._load())
        try:
            await until(lambda: watch.load is not None, "the first report")
            dropped = []
            real_publish = watch._publish_size

            def publish():  # called once the watch gave up on the stream (and after each report)
                dropped.append(watch.load is None)
                real_publish()

            watch._publish_size = publish  # type: ignore[method-assign]
            await until(lambda: any(dropped), "the silent stream's load dropped")
            opened = prefill.servicer.opened
            await until(lambda: len(opened) >= 2, "the stream opened again")
            assert opened[1] - opened[0] >= 0.9  # not before the silence allowed (1 s; timer slack aside)
            assert watch.pushed  # still pushed: the stream is opened again
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await watch.stop()
            await prefill.server.stop(None)

    asyncio.run(main())


def test_watch_load_answers_at_once_then_every_period():
    async def main():
        prefill = Prefill()
        await prefill.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{prefill.port}")
        try:
            stub = kpb_grpc.KvEventsStub(channel)
            call = stub.WatchLoad(kpb.LoadRequest(interval_ms=0))  # 0: the server's default period
            first = await call.read()
            assert first.ready and first.kv_blocks_total == 10 and first.block_size == 16
            prefill.in_flight = 2
            assert (await call.read()).in_flight == 2
            call.cancel()
        finally:
            await channel.close()
            await prefill.server.stop(None)

    asyncio.run(main())
