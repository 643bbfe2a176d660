"""EngineThread: one thread owns an engine; coroutines and other threads reach it through a queue.

An engine is not thread-safe, so every call runs on its thread, between steps:
- ``_call(fn, *args)`` (a coroutine) runs ``fn`` there and returns its result, or raises its
  exception, in the caller's event loop;
- ``_stream(rid, fn, *args)`` does the same, then yields the request's outputs as the thread
  ``_deliver``s them until one is finished; a consumer that stops early (break, cancellation,
  client gone) has the request aborted (``_abort``, on the thread);
- ``call_blocking(fn, *args)`` is ``_call`` for a plain thread (neither the engine's nor an
  event loop's).
After every call it runs the thread calls ``_publish()`` (before the caller resumes): a
subclass makes its counts readable from other threads there. The subclass owns the loop
(``_loop``: take the queued calls, step, deliver outputs; ``None`` on the queue with
``_stopping`` set ends it) and ``_abort`` / ``_abort_all`` (``stop`` aborts everything first).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from typing import AsyncIterator

from .sequence import RequestOutput


class EngineThread:
    THREAD_NAME = "pdserve-engine"

    def __init__(self):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ---- to provide ----------------------------------------------------------------------------
    def _loop(self) -> None:
        raise NotImplementedError

    def _abort(self, request_id: str) -> bool:
        raise NotImplementedError

    def _abort_all(self) -> None:
        raise NotImplementedError

    def _publish(self) -> None:
        """On the engine thread, after every call it runs: counts for other threads (none here)."""

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=self.THREAD_NAME, daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is None:
            return
        await self._call(self._abort_all)
        self._stopping = True
        self._calls.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _not_started(self) -> RuntimeError:
        return RuntimeError(f"{type(self).__name__} is not started (await start() first)")

    # ---- calls -----------------------------------------------------------------------------------
    def call_blocking(self, fn, *args, timeout: float | None = None):
        """From a thread other than the engine's and the event loop's: ``fn(*args)`` on the engine
        thread (between steps); its result or its exception."""
        if self._thread is None:
            raise self._not_started()
        if threading.current_thread() is self._thread:
            return fn(*args)
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, args, done))
        return done.result(timeout)

    async def _call(self, fn, *args):
        if self._thread is None:
            raise self._not_started()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._calls.put((fn, args, (loop, fut)))
        return await fut

    def _run_call(self, item) -> None:
        """On the engine thread: one queued call, its result or exception handed to its caller."""
        fn, args, reply = item
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
            self._publish()
            if isinstance(reply, concurrent.futures.Future):
                reply.set_exception(exc)
            elif reply is not None:
                loop, fut = reply
                loop.call_soon_threadsafe(set_exception, fut, exc)
            return
        self._publish()
        if isinstance(reply, concurrent.futures.Future):
            reply.set_result(result)
        elif reply is not None:
            loop, fut = reply
            loop.call_soon_threadsafe(set_result, fut, result)

    # ---- output streams --------------------------------------------------------------------------
    async def _stream(self, request_id: str, fn, *args) -> AsyncIterator[RequestOutput]:
        """Open the request's output stream, run ``fn(*args)`` on the engine thread (its error
        raises here), then yield the request's outputs until it finishes."""
        q = self._open_stream(request_id)
        try:
            await self._call(fn, *args)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        async for out in self._drain(request_id, q):
            yield out

    def _open_stream(self, request_id: str) -> asyncio.Queue:
        if self._thread is None:
            raise self._not_started()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        return q

    async def _drain(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                out = await q.get()
                if out.finished:
                    finished = True
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self._thread is not None:
                self._calls.put((self._abort, (request_id,), None))

    def _deliver(self, out: RequestOutput) -> None:
        """On the engine thread: hand an output to its request's stream (if one is open)."""
        target = self._streams.get(out.request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, out)


def set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
