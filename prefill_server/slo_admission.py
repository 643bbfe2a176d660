"""SloAdmission: requests wait here, in the order of the queue policy, while every decode (or
this prefill's own KV pool) is too full for them; asyncio over ``pdserve.slo.GlobalQueue``.

``PrefillNode.generate`` holds one ``Ticket`` per request::

    ticket = admission.ticket(slo_request)
    await ticket.turn()    # at once when nobody waits; else in line until the policy puts it first
    ...                    # try the decodes (on allocation: ticket.admitted, the next one goes)
    if not await ticket.wait():   # every decode was full: wait in line (head: try again soon)
        ...                # it waited --queue-timeout seconds: give up (503 as before)

Only the head of the policy's order (``--queue-policy fifo|edf|qlm``) tries the decodes while
requests wait; the others sleep until they become the head (the queue calls their
``SloRequest.wakeup`` whenever its order has a new head: a request joined, was admitted,
ended or gave up, or qlm's order changed with time), looking again every ``LOOK_S`` in any
case. The head tries again after a
short backoff (doubling from 10 ms to ``recheck_s``), since the picker learns of freed KV
blocks from the decodes' load reports. A request that does not have to wait (nobody is
waiting) never enters the queue. A client that goes away ends its request: the Frontend's
``GlobalQueue.finish`` takes it out of the queue at once.

The request's end-to-end deadline is enforced by the Frontend (it cancels the wait).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.slo import GlobalQueue, SloRequest

FIRST_BACKOFF_S = 0.01
RECHECK_S = 0.1
LOOK_S = 1.0  # a waiter that is not the head looks again this often even if nobody woke it


def decode_kv_blocks(picker) -> int:
    """The KV blocks of the routable decodes in all, from their latest load reports (the SLO
    queue's plans count blocks: a decode reserves prompt + max_tokens for a request)."""
    return sum(load.total_blocks for load in picker._usable().values())


class SloAdmission:
    def __init__(self, queue: GlobalQueue, max_wait_s: float, recheck_s: float = RECHECK_S):
        if not max_wait_s > 0:
            raise ValueError(f"max_wait_s must be > 0, got {max_wait_s}")
        self.queue, self.max_wait_s, self.recheck_s = queue, max_wait_s, recheck_s
        queue.on_change = self.notify

    def ticket(self, req: SloRequest) -> Ticket:
        return Ticket(self, req)

    def notify(self) -> None:
        """The waiting set changed, or room may have appeared: wake the head."""
        head = self.queue.head()  # a new head is woken by the queue itself (SloRequest.wakeup)
        if head is not None and head.wakeup is not None:
            head.wakeup()

    def __len__(self) -> int:
        return len(self.queue.waiting)


class Ticket:
    __slots__ = ("adm", "req", "event", "first_waited", "backoff")

    def __init__(self, adm: SloAdmission, req: SloRequest):
        self.adm, self.req = adm, req
        self.event = asyncio.Event()
        req.wakeup = self.event.set  # the queue calls it when this request becomes the head
        self.first_waited: float | None = None
        self.backoff = FIRST_BACKOFF_S

    def waited(self) -> float:
        return 0.0 if self.first_waited is None else self.adm.queue.clock() - self.first_waited

    def gave_up(self) -> str:
        return (f"waited {self.waited():.1f}s in the queue ({self.adm.queue.policy}) for a decode with free KV "
                f"blocks (--queue-timeout)")

    async def turn(self) -> bool:
        """Wait until this request may try the decodes: at once if nobody waits, else when the
        policy puts it first. False once it has waited max_wait_s (give up)."""
        q = self.adm.queue
        if self.req.state == "new":
            if not q.waiting:
                return True
            self._join()
        while q.head() is not self.req:
            left = self.adm.max_wait_s - self.waited()
            if left <= 0:
                return False
            self.event.clear()
            try:  # woken when it becomes the head; a look now and then in any case
                await asyncio.wait_for(self.event.wait(), min(left, LOOK_S))
            except asyncio.TimeoutError:
                pass
        return True

    async def wait(self) -> bool:
        """Every decode was too full: wait in line, then (as the head) try again after the
        backoff or when woken. False once it has waited max_wait_s."""
        if self.req.state == "new":
            self._join()
        left = self.adm.max_wait_s - self.waited()
        if left <= 0:
            return False
        self.event.clear()
        try:
            await asyncio.wait_for(self.event.wait(), min(self.backoff, left))
        except asyncio.TimeoutError:
            pass
        self.backoff = min(self.backoff * 2, self.adm.recheck_s)
        return await self.turn()

    def admitted(self) -> None:
        """A decode allocated the request: it leaves the queue; the next one may go."""
        self.adm.queue.admitted(self.req)

    def _join(self) -> None:
        if self.first_waited is None:
            self.first_waited = self.adm.queue.clock()
        self.adm.queue.wait(self.req)
