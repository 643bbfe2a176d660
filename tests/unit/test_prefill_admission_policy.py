"""AdmissionQueue with an SLO queue (pdserve.slo.GlobalQueue): the line is in the policy's
order, the policy's new head is woken (also when only time changed qlm's order), a request
leaves the SLO queue's line with its ticket and is counted as running once admitted; with
room (the prefill engine's own line has room: here a one-place semaphore stands for it) a request
waits in that line for room, so the policy picks who goes on each time a prompt was computed."""

import asyncio
import time

import pytest

from harness.conditions import settle, until
from pdserve.prefill_server.admission_queue import AdmissionQueue, QueueTimeout
from pdserve.slo import Estimator, GlobalQueue, parse

CLASSES = parse({"classes": [{"name": "interactive", "ttftMs": 1000}, {"name": "chat", "ttftMs": 2000},
                             {"name": "batch", "e2eMs": 60000}]})
INTERACTIVE, CHAT, BATCH = (CLASSES.by_name[n] for n in ("interactive", "chat", "batch"))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


class Capacity:
    def __init__(self, free):
        self.free = free

    def take(self, n):
        if n <= self.free:
            self.free -= n
            return True
        return False


async def admit(queue, slo, cap, rid, cls, n, order):
    """What PrefillNode.generate does with an SLO queue: turn, try, wait while full, admitted."""
    ticket = queue.ticket(rid, None, slo.arrive(rid, cls, 10, 10))
    try:
        while True:
            await ticket.turn()
            if cap.take(n):
                ticket.admitted()
                order.append(rid)
                return ticket
            await ticket.wait()
    finally:
        ticket.leave()


def test_edf_serves_an_interactive_request_before_the_batch_already_waiting():
    async def main():
        slo = GlobalQueue(CLASSES, "edf")
        q = AdmissionQueue(16, recheck_s=30, slo=slo)
        cap, order = Capacity(0), []
        batch = [asyncio.create_task(admit(q, slo, cap, f"b{i}", BATCH, 1, order)) for i in range(3)]
        await until(lambda: len(q) == 3, "the batch requests to wait")
        inter = asyncio.create_task(admit(q, slo, cap, "i", INTERACTIVE, 1, order))
        await until(lambda: len(q) == 4, "the interactive request to wait")
        assert [r.request_id for r in slo.order()][0] == "i"
        for k in range(4):
            cap.free += 1
            q.notify()
            await until(lambda: len(order) == k + 1, f"admission {k + 1}")
        await asyncio.gather(*batch, inter)
        assert order == ["i", "b0", "b1", "b2"]
        assert len(q) == 0 and not slo.waiting and set(slo.running) == {"i", "b0", "b1", "b2"}

    run(main())


def test_fifo_keeps_arrival_order():
    async def main():
        slo = GlobalQueue(CLASSES, "fifo")
        q = AdmissionQueue(16, recheck_s=30, slo=slo)
        cap, order = Capacity(0), []
        tasks = [asyncio.create_task(admit(q, slo, cap, "b0", BATCH, 1, order))]
        await until(lambda: len(q) == 1, "the batch request to wait")
        tasks.append(asyncio.create_task(admit(q, slo, cap, "i", INTERACTIVE, 1, order)))
        await until(lambda: len(q) == 2, "the interactive request to wait")
        cap.free = 2
        q.notify()
        await asyncio.gather(*tasks)
        assert order == ["b0", "i"]

    run(main())


def test_a_cancelled_waiter_leaves_both_lines_at_once():
    async def main():
        slo = GlobalQueue(CLASSES, "edf")
        q = AdmissionQueue(16, recheck_s=30, slo=slo)
        cap, order = Capacity(0), []
        head = asyncio.create_task(admit(q, slo, cap, "b0", BATCH, 1, order))
        behind = asyncio.create_task(admit(q, slo, cap, "b1", BATCH, 1, order))
        await until(lambda: len(q) == 2, "both to wait")
        assert len(slo.waiting) == 2
        behind.cancel()
        await asyncio.gather(behind, return_exceptions=True)
        assert len(q) == 1 and list(slo.waiting) == ["b0"]
        cap.free = 1
        q.notify()
        await head
        assert order == ["b0"] and not slo.waiting

    run(main())


def test_the_new_head_is_woken_when_only_time_changed_qlms_order():
    """The interactive request can no longer make its TTFT; the chat request behind it still
    can if it goes first: qlm's next decision (time only, no arrival or departure) makes chat
    the head, and its ticket is woken, not left asleep until its deadline."""
    async def main():
        est = Estimator()
        est.observe_gap(0.0, 1, 0.01)
        est.observe_prefill(100, 0.1)
        for cls, n in (("interactive", 20), ("chat", 20), ("batch", 50)):
            est.observe_output(cls, n)
        now = [100.0]
        slo = GlobalQueue(CLASSES, "qlm", clock=lambda: now[0], estimator=est)
        busy = slo.arrive("busy", BATCH, 100, 100)
        slo.admitted(busy)  # frees its slot in ~0.5 s
        q = AdmissionQueue(16, recheck_s=30, slo=slo, clock=lambda: now[0])
        i = q.ticket("i", None, slo.arrive("i", INTERACTIVE, 100, 20))  # 0.29 s of service
        c = q.ticket("c", None, slo.arrive("c", CHAT, 100, 20))
        await i.turn()
        i._enter()
        c._enter()
        assert q._head() is i
        woke = asyncio.create_task(c.turn())
        await settle()
        assert not woke.done()
        now[0] += 1.2
        assert not i.is_head()  # the old head looks again (its recheck): qlm decides anew, c first
        await woke  # c was woken by the queue, nobody else woke it
        assert q._head() is c
        c.leave()
        i.leave()
        assert len(q) == 0 and not slo.waiting

    run(main())


def test_a_resumed_request_goes_ahead_of_the_policys_line_and_stays_running():
    """A request the policy admitted whose decode failed mid-stream waits again (a resume): it is
    the head before the requests the policy has not admitted yet, and stays counted as running
    (no second admission)."""
    async def main():
        slo = GlobalQueue(CLASSES, "edf")
        q = AdmissionQueue(16, recheck_s=30, slo=slo)
        cap, order = Capacity(1), []
        first = await admit(q, slo, cap, "r", BATCH, 1, order)  # admitted at once, now running
        first.started()
        waiting = [asyncio.create_task(admit(q, slo, cap, f"i{k}", INTERACTIVE, 1, order)) for k in range(2)]
        await until(lambda: len(q) == 2, "two interactive requests to wait")
        assert set(slo.waiting) == {"i0", "i1"}
        resumed = asyncio.create_task(first.wait())
        await until(lambda: len(q) == 3, "the resumed request back in line")
        assert first.is_head() and set(slo.running) == {"r"}
        q.notify()
        await resumed
        cap.free = 3
        first.admitted()  # a decode took it again: out of the line; the policy's head goes next
        await asyncio.gather(*waiting)
        assert order == ["r", "i0", "i1"] and len(q) == 0 and not slo.waiting
        assert set(slo.running) == {"r", "i0", "i1"}

    run(main())



async def take_slot(queue, slo, slots, rid, cls, order, deadline=None):
    """What a request does with an ordering policy and room in the prefill engine's line (a one-place semaphore
    here): its turn, then the place (free at once, since its turn came only with room), then admitted; the place
    stays taken."""
    ticket = queue.ticket(rid, deadline, slo.arrive(rid, cls, 10, 10))
    try:
        await ticket.turn()
        assert not slots.locked(), f"{rid} got its turn without a free slot"
        await slots.acquire()
        ticket.admitted()
        order.append(rid)
    finally:
        ticket.leave()


def test_with_room_the_policy_not_arrival_picks_who_takes_a_freed_prefill_slot():
    async def main():
        slo, slots = GlobalQueue(CLASSES, "edf"), asyncio.Semaphore(1)
        q = AdmissionQueue(16, recheck_s=30, slo=slo, room=lambda: not slots.locked())
        order = []

        def give_back():  # what SessionRunner does once the engine computed a prompt (its line has room again)
            slots.release()
            q.notify()

        await take_slot(q, slo, slots, "b0", BATCH, order)  # a free slot and nobody waiting: at once
        tasks = [asyncio.create_task(take_slot(q, slo, slots, "b1", BATCH, order))]
        await until(lambda: len(q) == 1, "b1 to wait in line for the slot (nobody else waits)")
        tasks.append(asyncio.create_task(take_slot(q, slo, slots, "i", INTERACTIVE, order)))
        await until(lambda: len(q) == 2, "the interactive request to wait behind it")
        await settle()
        assert order == ["b0"]  # nobody went on without room
        give_back()
        await until(lambda: len(order) == 2, "one admission")
        await settle()
        assert order == ["b0", "i"] and len(q) == 1  # edf: the interactive one took the slot, not b1
        give_back()
        await asyncio.gather(*tasks)
        assert order == ["b0", "i", "b1"] and len(q) == 0 and not slo.waiting
        # they waited for a prefill slot, not because the decodes were full: that is not the backend's K
        assert slo.estimator.slots.value is None

    run(main())


def test_a_head_waiting_for_room_ends_at_its_deadline():
    async def main():
        slo, slots = GlobalQueue(CLASSES, "qlm"), asyncio.Semaphore(1)
        q = AdmissionQueue(16, recheck_s=0.05, slo=slo, room=lambda: not slots.locked())
        await slots.acquire()  # the only slot stays taken
        with pytest.raises(QueueTimeout) as err:
            await take_slot(q, slo, slots, "late", CHAT, [], deadline=time.monotonic() + 0.3)
        assert err.value.by_deadline and len(q) == 0 and not slo.waiting

    run(main())


def test_a_head_waiting_for_a_prefill_slot_past_the_queue_timeout_says_so():
    async def main():
        slo, slots = GlobalQueue(CLASSES, "edf"), asyncio.Semaphore(1)
        q = AdmissionQueue(16, max_wait_s=0.2, recheck_s=0.05, slo=slo, room=lambda: not slots.locked())
        await slots.acquire()  # the only slot stays taken; the decodes have room
        with pytest.raises(QueueTimeout) as err:
            await take_slot(q, slo, slots, "slow", CHAT, [])
        msg = str(err.value)
        assert "for room in the prefill's engine" in msg and "--max-num-batched-tokens" in msg, msg
        assert "KV blocks" not in msg, msg
        assert not err.value.by_deadline and len(q) == 0 and not slo.waiting

    run(main())
