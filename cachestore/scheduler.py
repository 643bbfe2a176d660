"""Which bytes go on a link next: MoLink's weighted-priority chunked transmission, or FIFO.

Pure logic (no sockets, no threads): a link's sender threads call ``pop()`` under a lock.

A ``Transfer`` is one ``store()`` call: one layer of one request, as runs of contiguous
blocks. ``PriorityScheduler`` follows MoLink's Algorithm 1:

* short transfers (at most ``short_blocks`` blocks) and urgent ones (priority > 0) wait in
  ``vq1`` and are sent whole, highest priority first, then first come first served;
* large transfers wait in ``vq2`` and are sent ``chunk_blocks`` at a time;
* each time ``vq1`` is served while ``vq2`` waits, the waiting weight ``W`` grows by one;
  once ``W >= max_wait`` (default 30) the head of ``vq2`` is sent in full, and any send from
  ``vq2`` resets ``W``. So a large transfer is never starved: between two of its chunks at
  most ``max_wait`` short transfers go first.

``FifoScheduler`` sends every transfer whole in arrival order (for comparison).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

DEFAULT_MAX_WAIT = 30


@dataclass(slots=True)
class Transfer:
    """One layer of one request: runs ``(src_block, dst_block, count)`` in order."""

    key: Hashable
    layer: int
    runs: list[tuple[int, int, int]]
    priority: int = 0
    context: Any = None  # opaque to the scheduler (the sender's request object)
    token: bytes = b""  # the request's bind token (entries.py): in its DATA headers / NIXL notification records
    corrupt: bool = False  # test hook (checksum.py): the link flips one byte of this transfer's next slice
    ready: Callable[[], None] | None = None  # blocks until the source bytes are written (a GPU event); None: they are
    seq: int = -1
    left: int = field(init=False)
    _run: int = field(init=False, default=0)
    _off: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not self.runs:
            raise ValueError("a Transfer needs at least one run of blocks")
        self.left = sum(n for _, _, n in self.runs)

    @property
    def total(self) -> int:
        return sum(n for _, _, n in self.runs)

    def wait_ready(self) -> None:
        """For a link's data thread, outside its lock: wait until the writer's copy of these bytes is done
        (``MemoryRegion.layer_written``); at once when there is nothing to wait for or it was waited for."""
        ready = self.ready
        if ready is not None:
            ready()
            self.ready = None

    def take(self, nblocks: int) -> list[tuple[int, int, int]]:
        """Hand out the next nblocks (or all that is left) as slices of the runs."""
        out: list[tuple[int, int, int]] = []
        want = min(nblocks, self.left)
        while want > 0:
            src, dst, count = self.runs[self._run]
            n = min(want, count - self._off)
            out.append((src + self._off, dst + self._off, n))
            self._off += n
            want -= n
            self.left -= n
            if self._off == count:
                self._run += 1
                self._off = 0
        return out


@dataclass(slots=True)
class Chunk:
    """What a sender thread puts on the wire next: slices of one transfer."""

    transfer: Transfer
    slices: list[tuple[int, int, int]]

    @property
    def nblocks(self) -> int:
        return sum(n for _, _, n in self.slices)


class PriorityScheduler:
    """MoLink Algorithm 1 over block counts (see the module docstring)."""

    def __init__(self, chunk_blocks: int, short_blocks: int | None = None, max_wait: int = DEFAULT_MAX_WAIT):
        if chunk_blocks <= 0:
            raise ValueError(f"chunk_blocks must be positive, got {chunk_blocks}")
        if max_wait <= 0:
            raise ValueError(f"max_wait must be positive, got {max_wait}")
        self.chunk_blocks = chunk_blocks
        self.short_blocks = chunk_blocks if short_blocks is None else short_blocks
        self.max_wait = max_wait
        self.waiting_weight = 0
        self._vq1: list[tuple[int, int, Transfer]] = []  # heap of (-priority, seq, transfer)
        self._vq2: deque[Transfer] = deque()
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._vq1) + len(self._vq2)

    def push(self, transfer: Transfer) -> None:
        transfer.seq = next(self._seq)
        if transfer.priority > 0 or transfer.total <= self.short_blocks:
            heapq.heappush(self._vq1, (-transfer.priority, transfer.seq, transfer))
        else:
            self._vq2.append(transfer)

    def pop(self) -> Chunk | None:
        if self._vq1 and self._vq2:
            self.waiting_weight += 1
        if self._vq1 and (self.waiting_weight < self.max_wait or not self._vq2):
            _, _, t = heapq.heappop(self._vq1)
            return Chunk(t, t.take(t.left))
        if self._vq2:
            head = self._vq2[0]
            n = head.left if self.waiting_weight >= self.max_wait else self.chunk_blocks
            chunk = Chunk(head, head.take(n))
            if head.left == 0:
                self._vq2.popleft()
            self.waiting_weight = 0
            return chunk
        return None

    def remove(self, key: Hashable) -> int:
        """Drop every queued transfer of key (a failed or deleted request); returns how many."""
        before = len(self)
        self._vq1 = [e for e in self._vq1 if e[2].key != key]
        heapq.heapify(self._vq1)
        self._vq2 = deque(t for t in self._vq2 if t.key != key)
        return before - len(self)


class FifoScheduler:
    """Every transfer whole, in arrival order."""

    def __init__(self, *_: Any, **__: Any):
        self._q: deque[Transfer] = deque()
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._q)

    def push(self, transfer: Transfer) -> None:
        transfer.seq = next(self._seq)
        self._q.append(transfer)

    def pop(self) -> Chunk | None:
        if not self._q:
            return None
        t = self._q.popleft()
        return Chunk(t, t.take(t.left))

    def remove(self, key: Hashable) -> int:
        before = len(self._q)
        self._q = deque(t for t in self._q if t.key != key)
        return before - len(self._q)


SCHEDULERS = {"priority": PriorityScheduler, "fifo": FifoScheduler}


def make_scheduler(name: str, chunk_blocks: int, max_wait: int = DEFAULT_MAX_WAIT):
    if name not in SCHEDULERS:
        raise ValueError(f"scheduler must be one of {sorted(SCHEDULERS)}, got {name!r}")
    if name == "fifo":
        return FifoScheduler()
    return PriorityScheduler(chunk_blocks, max_wait=max_wait)
