"""SloAdmission (prefill_server/slo_admission.py): only the head of the policy's order tries,
the next one goes at once when the head is admitted, waiting ends after max_wait_s."""

import asyncio
import time

import pytest

from pdserve.prefill_server.slo_admission import SloAdmission
from pdserve.slo import GlobalQueue, parse

CLASSES = parse({"classes": [{"name": "interactive", "ttftMs": 1000}, {"name": "batch", "e2eMs": 60000}]})


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_nobody_waiting_means_no_queue():
    async def main():
        q = GlobalQueue(CLASSES, "fifo")
        adm = SloAdmission(q, max_wait_s=5)
        t = adm.ticket(q.arrive("a", CLASSES.default, 10, 10))
        assert await t.turn() is True
        assert not q.waiting and len(adm) == 0
    run(main())


def test_the_head_goes_first_and_the_next_goes_when_it_is_admitted():
    async def main():
        q = GlobalQueue(CLASSES, "edf")
        adm = SloAdmission(q, max_wait_s=5)
        batch = adm.ticket(q.arrive("b", CLASSES.by_name["batch"], 10, 10))
        assert await batch.wait() is True  # every decode full: it waits, and as the head tries again
        inter = adm.ticket(q.arrive("i", CLASSES.by_name["interactive"], 10, 10))
        assert await inter.turn() is True  # edf: it is the head at once
        later = asyncio.create_task(batch.turn())
        await asyncio.sleep(0.05)
        assert not later.done()  # not the head: it sleeps
        t0 = time.monotonic()
        inter.admitted()
        assert await later is True and time.monotonic() - t0 < 0.5  # woken (unwoken it would look after LOOK_S, 1 s)
        batch.admitted()
        assert not q.waiting and set(q.running) == {"i", "b"}
    run(main())


def test_waiting_ends_after_max_wait_and_a_cancelled_waiter_leaves_at_once():
    async def main():
        q = GlobalQueue(CLASSES, "fifo")
        adm = SloAdmission(q, max_wait_s=0.3)
        a = adm.ticket(q.arrive("a", CLASSES.default, 10, 10))
        tries = 0
        t0 = time.monotonic()
        while await a.wait():
            tries += 1
        assert 0.3 <= time.monotonic() - t0 < 2.0 and tries >= 3  # backoff 10, 20, 40, ... ms, then it gives up
        assert "waited 0.3s in the queue (fifo)" in a.gave_up()
        q.finish(a.req, "error")
        adm2 = SloAdmission(GlobalQueue(CLASSES, "fifo"), max_wait_s=5)
        q2 = adm2.queue
        head = adm2.ticket(q2.arrive("h", CLASSES.default, 10, 10))
        await head.wait()
        behind = adm2.ticket(q2.arrive("x", CLASSES.default, 10, 10))
        task = asyncio.create_task(behind.turn())
        await asyncio.sleep(0.05)
        task.cancel()  # the client went away; the Frontend ends the request
        with pytest.raises(asyncio.CancelledError):
            await task
        q2.finish(behind.req, "cancelled")
        assert list(q2.waiting) == ["h"]
    run(main())
