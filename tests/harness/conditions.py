"""Waiting for a condition instead of sleeping for a while: a test waits until what it needs is
observable (a /health counter, a metric, a queue length, a stream's first token), polling with a
short pause, and the only time bound is a hang guard.

    wait_until(lambda: queued(prefill) == 2, "two requests queued")           # threads, processes
    await until(lambda: len(q) == 3, "three tickets in line")                 # in an event loop
    await settle()      # every task that can run has run (event-loop rounds, no clock)

A hang guard is about ten times what the wait takes on a loaded box: it only ends a broken test
with the name of what never happened, it never decides whether a test passes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, TypeVar

T = TypeVar("T")

HANG_GUARD_S = 30.0  # only a hang guard
PAUSE_S = 0.05       # between two looks at a condition read over HTTP or from another process
ASYNC_PAUSE_S = 0.01  # between two looks inside one event loop (the condition is cheap)


def wait_until(cond: Callable[[], T], what: str, hang_guard_s: float = HANG_GUARD_S, pause_s: float = PAUSE_S) -> T:
    """Return ``cond()``'s first truthy value; AssertionError naming ``what`` after the hang guard."""
    deadline = time.monotonic() + hang_guard_s
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"hang guard: not within {hang_guard_s:g}s: {what}")
        time.sleep(pause_s)
    return value


async def until(cond: Callable[[], T], what: str, hang_guard_s: float = HANG_GUARD_S,
                pause_s: float = ASYNC_PAUSE_S) -> T:
    """``wait_until`` inside an event loop (the other tasks run while it waits)."""
    deadline = time.monotonic() + hang_guard_s
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"hang guard: not within {hang_guard_s:g}s: {what}")
        await asyncio.sleep(pause_s)
    return value


async def settle(rounds: int = 50) -> None:
    """Let every task that is ready run as far as it can without waiting for I/O or a timer: for a
    check that something did NOT happen (a task still waits) once everything that could happen has."""
    for _ in range(rounds):
        await asyncio.sleep(0)
