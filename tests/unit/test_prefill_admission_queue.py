"""AdmissionQueue: first come first served, only the head tries, woken by notify / its turn,
bounded by length (QueueFull) and deadline (QueueTimeout), left at once when cancelled.

Synchronised by events: a test waits until the tickets it needs are in line (``until``), and checks
that something did not happen once every task that could run has run (``settle``). Deadlines and
waits are on a clock the test moves (``Clock``); the queue's real-time timers (its recheck) are set
far off, and ``notify`` makes the head look at the clock again."""

import asyncio
import time

import pytest

from harness.conditions import settle, until
from pdserve.prefill_server.admission_queue import DEADLINE_MARGIN_S, AdmissionQueue, QueueFull, QueueTimeout

HANG_GUARD_S = 10.0  # only a hang guard


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, HANG_GUARD_S))


class Capacity:
    """A pool of blocks the 'decode' frees on demand; requests take blocks when their turn comes.
    ``tried``: the request ids that tried, in order."""

    def __init__(self, free):
        self.free = free
        self.tried: list[str] = []

    def take(self, n, rid=""):
        self.tried.append(rid)
        if n <= self.free:
            self.free -= n
            return True
        return False


class Clock:
    """The queue's clock, moved by the test."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


async def admit(queue, cap, rid, n, order, deadline=None):
    """What PrefillNode.generate does: turn, try, wait while full, leave once allocated."""
    ticket = queue.ticket(rid, deadline)
    try:
        while True:
            await ticket.turn()
            if cap.take(n, rid):
                ticket.leave()
                order.append(rid)
                return ticket
            await ticket.wait()
    finally:
        ticket.leave()


def test_empty_queue_is_passed_straight_through():
    async def main():
        lengths = []
        q = AdmissionQueue(4, on_length=lengths.append)
        order = []
        await admit(q, Capacity(10), "a", 3, order)
        assert order == ["a"] and len(q) == 0 and lengths == []  # never queued

    run(main())


def test_fifo_no_overtaking_and_notify_wakes_the_head():
    async def main():
        lengths = []
        q = AdmissionQueue(8, recheck_s=30, on_length=lengths.append)  # no recheck: only notify / turn wake
        cap, order = Capacity(0), []
        big = asyncio.create_task(admit(q, cap, "big", 5, order))
        await until(lambda: len(q) == 1, "the big request to wait")
        small = [asyncio.create_task(admit(q, cap, f"s{i}", 1, order)) for i in range(3)]
        await until(lambda: len(q) == 4, "the small ones to wait behind it")
        assert order == [] and cap.tried == ["big"]  # the small ones never tried: not the head
        cap.free = 3  # room for every small one, but the big one is first in line
        q.notify()
        await until(lambda: len(cap.tried) == 2, "the head to try again")
        await settle()
        assert cap.tried == ["big", "big"] and order == [], "a later small request overtook the waiting head"
        cap.free = 8
        q.notify()  # the head goes; each leaving head wakes the next one at once
        await asyncio.gather(big, *small)
        assert order == ["big", "s0", "s1", "s2"] and cap.free == 0
        assert len(q) == 0 and max(lengths) == 4 and lengths[-1] == 0

    run(main())


def test_a_new_arrival_queues_behind_waiting_requests_even_with_room():
    async def main():
        q = AdmissionQueue(8, recheck_s=30)
        cap, order = Capacity(0), []
        first = asyncio.create_task(admit(q, cap, "first", 4, order))
        await until(lambda: len(q) == 1, "the first request to wait")
        cap.free = 2  # enough for the newcomer, not for the head
        late = asyncio.create_task(admit(q, cap, "late", 1, order))
        await until(lambda: len(q) == 2, "the newcomer to queue")
        assert order == [] and "late" not in cap.tried
        cap.free = 5
        q.notify()
        await asyncio.gather(first, late)
        assert order == ["first", "late"]

    run(main())


def test_the_head_rechecks_without_a_notify():
    async def main():
        q = AdmissionQueue(8, recheck_s=0.02)
        cap, order = Capacity(0), []
        task = asyncio.create_task(admit(q, cap, "a", 1, order))
        await until(lambda: len(q) == 1, "the request to wait after its first try")
        cap.free = 1  # nobody says so
        await task
        assert order == ["a"] and cap.tried.count("a") >= 2  # it tried again on its own

    run(main())


def test_queue_full_is_refused_at_once():
    async def main():
        q = AdmissionQueue(2, recheck_s=30)
        cap, order = Capacity(0), []
        waiting = [asyncio.create_task(admit(q, cap, f"w{i}", 1, order)) for i in range(2)]
        await until(lambda: len(q) == 2, "two requests to wait")
        with pytest.raises(QueueFull, match="2 requests wait"):
            await admit(q, cap, "extra", 1, order)
        assert len(q) == 2
        for t in waiting:
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        assert len(q) == 0

    run(main())


def test_deadline_while_queued_raises_and_leaves():
    async def main():
        clock = Clock()
        q = AdmissionQueue(8, recheck_s=30, clock=clock)
        cap, order = Capacity(0), []
        short = asyncio.create_task(admit(q, cap, "short", 1, order, deadline=60.0))
        await until(lambda: len(q) == 1, "the request with a deadline to wait")
        other = asyncio.create_task(admit(q, cap, "other", 1, order))
        await until(lambda: len(q) == 2, "another one to wait behind it")
        clock.now = 60.0 - DEADLINE_MARGIN_S - 0.1  # not yet: it tries again and goes on waiting
        q.notify()
        await until(lambda: cap.tried.count("short") == 2, "the head to try again")
        await settle()
        assert not short.done()
        clock.now = 60.0 - DEADLINE_MARGIN_S  # the queue gives up a margin before the deadline
        q.notify()
        with pytest.raises(QueueTimeout, match="admission queue") as info:
            await short
        assert info.value.by_deadline and "waited 59.9s" in str(info.value) and "until its deadline" in str(info.value)
        assert len(q) == 1  # the other one still waits
        other.cancel()
        await asyncio.gather(other, return_exceptions=True)
        assert len(q) == 0

    run(main())


def test_max_wait_gives_up_without_the_deadline():
    async def main():
        q = AdmissionQueue(8, max_wait_s=0.1, recheck_s=0.02)
        with pytest.raises(QueueTimeout, match="--queue-timeout") as info:
            await admit(q, Capacity(0), "a", 1, [], deadline=time.monotonic() + 60)
        assert not info.value.by_deadline and len(q) == 0

    run(main())


def test_a_cancelled_head_hands_over_to_the_next():
    async def main():
        q = AdmissionQueue(8, recheck_s=30)
        cap, order = Capacity(0), []
        gone = asyncio.create_task(admit(q, cap, "gone", 1, order))
        await until(lambda: len(q) == 1, "the head to wait")
        nxt = asyncio.create_task(admit(q, cap, "next", 1, order))
        await until(lambda: len(q) == 2, "the next one to wait behind it")
        cap.free = 1
        gone.cancel()  # the client went away: out of the queue at once, the next one tries
        await nxt
        assert order == ["next"] and len(q) == 0

    run(main())


def test_a_ticket_that_started_re_enters_at_its_arrival_position():
    """A resumed request (its decode failed after the first token) waits again: behind an older
    request still waiting, ahead of the ones that arrived after it; its new wait counts from
    when it re-entered; the gauge and the queue go back to 0."""
    async def main():
        lengths = []
        clock = Clock()
        q = AdmissionQueue(8, recheck_s=30, on_length=lengths.append, clock=clock)
        older = q.ticket("older")
        resumed = q.ticket("resumed")
        await resumed.turn()  # the queue is empty: straight on
        older._enter()  # arrived first, waits (e.g. its decode refused it meanwhile)
        resumed.started()  # its first token; no-op on the line (it never waited), its wait is over
        newer = [q.ticket(f"n{i}") for i in range(2)]
        for t in newer:
            t._enter()
        assert [t.request_id for t in q._waiting] == ["older", "n0", "n1"]
        clock.now = 5.0  # the resumed request streamed for a while
        task = asyncio.create_task(resumed.wait())  # its decode failed mid-stream: back in line
        await until(lambda: resumed.queued, "the resumed request back in line")
        assert [t.request_id for t in q._waiting] == ["older", "resumed", "n0", "n1"]
        assert resumed.waited() == 0  # from re-entering, not from arrival
        older.leave()  # the older one went: the resumed request is the head, before n0 and n1
        q.notify()
        await task
        assert resumed.is_head() and not newer[0].is_head()
        resumed.started()  # a decode took it again
        assert resumed.queued_at is None and newer[0].is_head()
        for t in newer:
            t.leave()
        assert len(q) == 0 and lengths[-1] == 0 and max(lengths) == 4

    run(main())


def test_max_wait_counts_from_re_entry_after_started():
    async def main():
        clock = Clock()
        q = AdmissionQueue(8, max_wait_s=60, recheck_s=30, clock=clock)
        t = q.ticket("a")
        t._enter()
        clock.now = 61.0  # waited longer than max_wait_s, then a decode took it
        t.started()
        other = q.ticket("b")
        other._enter()  # someone waits: the re-entered ticket is not the head at once
        waiting = asyncio.create_task(t.wait())  # its own wait again: a full max_wait_s, not a timeout at once
        await until(lambda: t.queued, "the ticket back in line")
        await settle()
        assert not waiting.done()
        clock.now = 121.0  # max_wait_s after it re-entered
        q.notify()
        with pytest.raises(QueueTimeout, match="--queue-timeout") as info:
            await waiting
        assert "waited 60.0s" in str(info.value)
        t.leave()
        other.leave()
        assert len(q) == 0

    run(main())


def test_wait_until_bounds_one_wait_in_place_of_max_wait():
    async def main():
        clock = Clock()
        q = AdmissionQueue(8, max_wait_s=0.05, recheck_s=30, clock=clock)

        async def waits(t, until_s):
            while True:  # the head is woken (here by notify, else every recheck_s): what the node does, until its limit
                await t.wait(until=until_s)

        t = q.ticket("a", deadline=60.0)
        task = asyncio.create_task(waits(t, 0.3))
        await until(lambda: t.queued, "the ticket to wait")
        clock.now = 0.1  # past max_wait_s: `until` bounds this wait instead
        q.notify()
        await settle()
        assert not task.done()
        clock.now = 0.3
        q.notify()
        with pytest.raises(QueueTimeout, match="limit of this wait") as info:
            await task
        assert not info.value.by_deadline and "waited 0.3s" in str(info.value)
        t.leave()
        t = q.ticket("b", deadline=clock.now + 0.3)
        task = asyncio.create_task(waits(t, clock.now + 60))
        await until(lambda: t.queued, "the ticket to wait")
        clock.now += 0.3  # the deadline still comes first
        q.notify()
        with pytest.raises(QueueTimeout) as info:
            await task
        assert info.value.by_deadline
        t.leave()
        assert len(q) == 0

    run(main())


def test_bad_settings():
    with pytest.raises(ValueError):
        AdmissionQueue(-1)
    with pytest.raises(ValueError):
        AdmissionQueue(1, max_wait_s=0)
