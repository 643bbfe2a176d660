"""AdmissionQueue: first come first served, only the head tries, woken by notify / its turn,
bounded by length (QueueFull) and deadline (QueueTimeout), left at once when cancelled."""

import asyncio
import time

import pytest

from pdserve.prefill_server.admission_queue import DEADLINE_MARGIN_S, AdmissionQueue, QueueFull, QueueTimeout


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


class Capacity:
    """A pool of blocks the 'decode' frees on demand; requests take blocks when their turn comes."""

    def __init__(self, free):
        self.free = free

    def take(self, n):
        if n <= self.free:
            self.free -= n
            return True
        return False


async def admit(queue, cap, rid, n, order, deadline=None):
    """What PrefillNode.generate does: turn, try, wait while full, leave once allocated."""
    ticket = queue.ticket(rid, deadline)
    try:
        while True:
            await ticket.turn()
            if cap.take(n):
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
        await asyncio.sleep(0.01)
        small = [asyncio.create_task(admit(q, cap, f"s{i}", 1, order)) for i in range(3)]
        await asyncio.sleep(0.01)
        assert len(q) == 4 and order == []
        cap.free = 3  # room for every small one, but the big one is first in line
        q.notify()
        await asyncio.sleep(0.01)
        assert order == [], "a later small request overtook the waiting head"
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
        await asyncio.sleep(0.01)
        cap.free = 2  # enough for the newcomer, not for the head
        late = asyncio.create_task(admit(q, cap, "late", 1, order))
        await asyncio.sleep(0.01)
        assert order == [] and len(q) == 2
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
        await asyncio.sleep(0.05)
        cap.free = 1  # nobody says so
        await task
        assert order == ["a"]

    run(main())


def test_queue_full_is_refused_at_once():
    async def main():
        q = AdmissionQueue(2, recheck_s=30)
        cap, order = Capacity(0), []
        waiting = [asyncio.create_task(admit(q, cap, f"w{i}", 1, order)) for i in range(2)]
        await asyncio.sleep(0.01)
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
        q = AdmissionQueue(8, recheck_s=30)
        cap, order = Capacity(0), []
        start = time.monotonic()
        head = asyncio.create_task(admit(q, cap, "head", 1, order))
        await asyncio.sleep(0.01)
        with pytest.raises(QueueTimeout, match="admission queue") as info:
            await admit(q, cap, "short", 1, order, deadline=time.monotonic() + 0.3)
        assert info.value.by_deadline
        assert 0.3 - DEADLINE_MARGIN_S - 0.05 <= time.monotonic() - start <= 0.3 + 0.5
        assert len(q) == 1  # the other one still waits
        head.cancel()
        await asyncio.gather(head, return_exceptions=True)
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
        await asyncio.sleep(0.01)
        nxt = asyncio.create_task(admit(q, cap, "next", 1, order))
        await asyncio.sleep(0.01)
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
        q = AdmissionQueue(8, recheck_s=30, on_length=lengths.append)
        older = q.ticket("older")
        resumed = q.ticket("resumed")
        await resumed.turn()  # the queue is empty: straight on
        older._enter()  # arrived first, waits (e.g. its decode refused it meanwhile)
        resumed.started()  # its first token; no-op on the line (it never waited), its wait is over
        newer = [q.ticket(f"n{i}") for i in range(2)]
        for t in newer:
            t._enter()
        assert [t.request_id for t in q._waiting] == ["older", "n0", "n1"]
        await asyncio.sleep(0.05)
        task = asyncio.create_task(resumed.wait())  # its decode failed mid-stream: back in line
        await asyncio.sleep(0.01)
        assert [t.request_id for t in q._waiting] == ["older", "resumed", "n0", "n1"]
        assert resumed.waited() < 0.04  # from re-entering, not from arrival
        older.leave()  # the older one went: the resumed request is the head, before n0 and n1
        q.notify()
        await asyncio.wait_for(task, 1)
        assert resumed.is_head() and not newer[0].is_head()
        resumed.started()  # a decode took it again
        assert resumed.queued_at is None and newer[0].is_head()
        for t in newer:
            t.leave()
        assert len(q) == 0 and lengths[-1] == 0 and max(lengths) == 4

    run(main())


def test_max_wait_counts_from_re_entry_after_started():
    async def main():
        q = AdmissionQueue(8, max_wait_s=0.2, recheck_s=30)
        t = q.ticket("a")
        t._enter()
        await asyncio.sleep(0.25)  # waited longer than max_wait_s, then a decode took it
        t.started()
        other = q.ticket("b")
        other._enter()  # someone waits: the re-entered ticket is not the head at once
        start = time.monotonic()
        with pytest.raises(QueueTimeout, match="--queue-timeout"):
            await t.wait()  # its own wait again: a full max_wait_s, not a timeout at once
        assert time.monotonic() - start >= 0.15
        t.leave()
        other.leave()
        assert len(q) == 0

    run(main())


def test_wait_until_bounds_one_wait_in_place_of_max_wait():
    async def main():
        q = AdmissionQueue(8, max_wait_s=0.05, recheck_s=0.02)
        t = q.ticket("a", deadline=time.monotonic() + 60)
        start = time.monotonic()
        with pytest.raises(QueueTimeout, match="limit of this wait") as info:
            while True:  # the head is woken every recheck_s: what the node does, until its limit
                await t.wait(until=start + 0.3)
        assert not info.value.by_deadline and 0.3 <= time.monotonic() - start < 1.5
        t.leave()
        t = q.ticket("b", deadline=time.monotonic() + 0.3)
        with pytest.raises(QueueTimeout) as info:  # the deadline still comes first
            while True:
                await t.wait(until=time.monotonic() + 60)
        assert info.value.by_deadline
        t.leave()
        assert len(q) == 0

    run(main())


def test_bad_settings():
    with pytest.raises(ValueError):
        AdmissionQueue(-1)
    with pytest.raises(ValueError):
        AdmissionQueue(1, max_wait_s=0)
