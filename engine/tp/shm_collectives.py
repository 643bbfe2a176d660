"""The model's collectives through shared memory, for the ranks of one CPU engine (they share a host).

A decode step of a tensor-parallel engine makes two all-reduces per layer and one logits gather, each of a
few kilobytes; over gloo each is a round trip through loopback TCP and gloo's threads, which cost more than
the half of the layer's matmuls a rank saves at batch 1. Here each is a copy into a shared buffer, a wait
for the other ranks' copies, and a sum (or a concatenation) that every rank computes itself, in rank order,
so every rank ends with the same bytes.

Layout of the segment (a file in /dev/shm that rank 0 creates, the others open, and rank 0 unlinks once all
have mapped it, so nothing is left behind even if every rank is killed): one flag per rank (an int64, each
on its own 64-byte line), then two buffers of ``size`` slots of ``SLOT_BYTES``. Operation k uses buffer
k % 2: a rank copies its tensor into its slot of that buffer, stores k in its flag, then waits until every
flag is >= k. No rank can be two operations ahead of another (it would need that rank's flag), so the
buffer it overwrites is one nobody still reads. x86's stores are seen in order by the other cores (the
flag after the data); on other architectures ``usable()`` says no and gloo stays.

A wait spins a little (the ranks of a step arrive within microseconds of each other on cores of their own),
then sleeps in ``select`` on its rank's FIFO: a rank that stores its flag writes a byte into every other
rank's FIFO (non-blocking; a full FIFO already holds a wake-up), so a rank whose peer is descheduled (a
shared, busy machine) sleeps instead of taking the core that peer needs. Every ``CHECK_S`` a sleeping rank
asks ``lost()`` whether a peer's process has gone (a RuntimeError naming it: the engine is lost, as when a
gloo collective fails) and gives up after ``timeout_s`` ("timed out"). The FIFOs sit beside the segment
(``PATH.RANK``) and are unlinked with it.
Tensors larger than a slot (prefill activations) go by gloo: the caller asks ``fits`` first, and since the
ranks' shapes are equal, they all choose alike.
"""

from __future__ import annotations

import mmap
import os
import platform
import select
import time
import uuid
from typing import Callable

import numpy as np
import torch

SLOT_BYTES = 1 << 20  # per rank and buffer: a decode step's activations (256 rows x 1024 float32) fit
FLAG_STRIDE = 8  # int64s between two ranks' flags (64 bytes: no false sharing)
SPIN = 300  # flag checks (about 30-50 us) before sleeping on the FIFO
CHECK_S = 0.01  # how often a wait asks whether a peer is lost
SHM_DIR = "/dev/shm"


def usable(device: torch.device) -> bool:
    """Whether this host can run them: ranks on the CPU, stores seen in order (x86), a shared-memory folder."""
    return (device.type == "cpu" and platform.machine().lower() in ("x86_64", "amd64")
            and os.access(SHM_DIR, os.W_OK))


def create_segment(size: int) -> str:
    """Rank 0: a new segment for ``size`` ranks (its path; ``unlink`` it once every rank has opened it)."""
    path = os.path.join(SHM_DIR, f"pdserve-tp-{uuid.uuid4().hex}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, segment_bytes(size))
    finally:
        os.close(fd)
    for rank in range(size):
        os.mkfifo(f"{path}.{rank}", 0o600)
    return path


def unlink_segment(path: str, size: int) -> None:
    """Rank 0, once every rank has opened them: the segment and the FIFOs leave /dev/shm (mapped/open ones stay)."""
    for name in (path, *(f"{path}.{rank}" for rank in range(size))):
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass


def segment_bytes(size: int) -> int:
    return 64 * size + 2 * size * SLOT_BYTES


class ShmCollectives:
    def __init__(self, path: str, rank: int, size: int, timeout_s: float, lost: Callable[[], str | None]):
        self.path, self.rank, self.size, self.timeout_s, self.lost = path, rank, size, timeout_s, lost
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, segment_bytes(size))
        finally:
            os.close(fd)
        self._flags = np.frombuffer(self._mm, dtype=np.int64, count=FLAG_STRIDE * size)
        data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=64 * size, count=2 * size * SLOT_BYTES)
        self._buffers = data.view(2, size, SLOT_BYTES)
        self._seq = 0
        # O_RDWR: a FIFO opened so never blocks and needs no reader yet; each rank reads its own
        self._fifos = [os.open(f"{path}.{r}", os.O_RDWR | os.O_NONBLOCK) for r in range(size)]

    @staticmethod
    def fits(t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.is_contiguous() and t.numel() * t.element_size() <= SLOT_BYTES

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (contiguous, ``fits``) becomes the sum over ranks, added in rank order on every rank."""
        parts = self._exchange(t)
        flat = t.view(-1)
        flat.copy_(parts[0])
        for j in range(1, self.size):
            flat.add_(parts[j])
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` ``[..., n]`` side by side: ``[..., size * n]`` (a new tensor)."""
        parts = self._exchange(t)
        n = t.shape[-1]
        return parts.view(self.size, -1, n).permute(1, 0, 2).reshape(*t.shape[:-1], self.size * n)

    def close(self) -> None:
        for fd in self._fifos:
            os.close(fd)
        self._fifos = []
        self._buffers = self._flags = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a view still lives somewhere: the mapping goes with the process
            pass

    def _exchange(self, t: torch.Tensor) -> torch.Tensor:
        """Copy ``t`` into this rank's slot, wait for every rank's: the slots as ``[size, numel]`` of t's dtype."""
        self._seq += 1
        nbytes = t.numel() * t.element_size()
        slots = self._buffers[self._seq % 2]
        slots[self.rank, :nbytes].copy_(t.reshape(-1).view(torch.uint8))
        self._flags[self.rank * FLAG_STRIDE] = self._seq
        for r, fd in enumerate(self._fifos):
            if r != self.rank:
                try:
                    os.write(fd, b"\1")
                except BlockingIOError:
                    pass  # full: that rank has wake-ups enough
        self._wait(self._seq)
        return slots[:, :nbytes].view(t.dtype)

    def _wait(self, seq: int) -> None:
        flags, mine = self._flags, self._fifos[self.rank]
        for j in range(self.size):
            spins, deadline = 0, 0.0
            while flags[j * FLAG_STRIDE] < seq:
                spins += 1
                if spins < SPIN:
                    continue
                if select.select([mine], [], [], CHECK_S)[0]:
                    try:
                        os.read(mine, 4096)  # every wake-up so far (the flags say which are news)
                    except BlockingIOError:
                        pass
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                self._check(j, now, deadline)

    def _check(self, rank: int, now: float, deadline: float) -> None:
        why = self.lost()
        if why:
            raise RuntimeError(f"shared-memory collective: {why}")
        if now >= deadline:
            raise RuntimeError(f"shared-memory collective timed out after {self.timeout_s:g}s waiting for "
                               f"tensor-parallel rank {rank}")
