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


def test_bad_settings():
    with pytest.raises(ValueError):
        AdmissionQueue(-1)
    with pytest.raises(ValueError):
        AdmissionQueue(1, max_wait_s=0)
