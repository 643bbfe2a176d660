"""Waits on the event loop, woken from any thread: the subscribe-then-look plumbing of both sides.

Contract: ``await WaiterBook.wait(rid, key, timeout_s, ready, on_timeout)`` subscribes an
asyncio future first and only then calls ``ready(rid, key)``, so a thread that changes the
state in between either sees the subscriber (and its wake-up re-checks it) or changed the
state before the look. No polling, no thread held. ``ready`` returns True when done and
raises ``TransferError`` (or ``UnknownRequestError``) when the wait must fail; on timeout the
error ``on_timeout(rid, key, timeout_s)`` returns is raised (it may also fail the request). Cancelling
the awaiting task only ends that wait.

``wake``/``fail`` run on the loop thread; other threads hand them over with ``LoopCaller``.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Generic, Hashable, TypeVar

from .errors import TransferError, UnknownRequestError

K = TypeVar("K", bound=Hashable | None)  # what a waiter waits for: a layer, or None for everything
Ready = Callable[[str, K], bool]


def check_timeout(timeout_s: object) -> None:
    """ValueError unless timeout_s is a positive number of seconds."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")


class LoopCaller:
    """Runs callbacks on one event loop from any thread (dropped once the loop is closed)."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None

    def attach(self) -> None:
        """Bind to the running loop (call from a coroutine)."""
        self.loop = asyncio.get_running_loop()

    def require(self, what: str) -> asyncio.AbstractEventLoop:
        if self.loop is None:
            raise RuntimeError(f"call await {what}.start() first")
        return self.loop

    def call(self, fn: Callable, *args) -> None:
        loop = self.require("the sender or receiver")  # not attached yet: an error, not a dropped callback
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during shutdown
            pass


class WaiterBook(Generic[K]):
    """Futures waiting on request ids, each with a key (a layer, or None for "everything")."""

    def __init__(self) -> None:
        self._by_rid: dict[str, list[tuple[K, asyncio.Future]]] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self._by_rid

    def count(self) -> int:
        return sum(len(v) for v in self._by_rid.values())

    async def wait(self, rid: str, key: K, timeout_s: float, ready: Ready[K],
                   on_timeout: Callable[[str, K, float], TransferError]) -> None:
        check_timeout(timeout_s)
        fut = asyncio.get_running_loop().create_future()
        self._by_rid.setdefault(rid, []).append((key, fut))
        try:
            if ready(rid, key):
                return
            async with asyncio.timeout(timeout_s):
                await fut
        except asyncio.TimeoutError:
            raise on_timeout(rid, key, timeout_s) from None
        finally:
            ws = self._by_rid.get(rid)
            if ws is not None:
                ws[:] = [(k, f) for k, f in ws if f is not fut]
                if not ws:
                    del self._by_rid[rid]

    def wake(self, rid: str, ready: Ready[K]) -> None:
        """Loop thread: re-check every waiter of rid; finish those that are done or failed."""
        for key, fut in list(self._by_rid.get(rid, ())):
            if fut.done():
                continue
            try:
                if ready(rid, key):
                    fut.set_result(None)
            except TransferError as exc:
                fut.set_exception(exc)
            except UnknownRequestError as exc:
                fut.set_exception(TransferError(str(exc)))

    def fail(self, rid: str, exc: TransferError) -> None:
        """Loop thread: every waiter of rid raises exc."""
        for _, fut in self._by_rid.get(rid, ()):
            if not fut.done():
                fut.set_exception(exc)
