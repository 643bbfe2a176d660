"""EngineThread: one thread owns an engine; coroutines reach it through a queue of calls.

``_call(fn, *args)`` runs ``fn`` on the engine thread between steps and returns its result (or
raises its exception) in the caller's event loop; ``_stream(rid, fn, *args)`` does the same and
then yields the request's outputs as the thread delivers them (``_deliver``); leaving the
stream early aborts the request (``_abort``). The thread steps the engine (``_step``) while it is
busy (``_busy``), hands each output to ``_on_output``, and sleeps on the queue otherwise. A step
that raises fails every request held (``_fail_all``). Subclasses provide ``_step``, ``_busy``,
``_on_output`` and ``_abort_all``/``_abort``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import AsyncIterator

from pdserve.engine.sequence import RequestOutput

log = logging.getLogger(__name__)
IDLE_POLL_S = 0.002  # a step with no output (waiting for KV to arrive or a release): how long to rest


class EngineThread:
    def __init__(self):
        self._calls: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._firsts: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False

    async def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="vllm-engine", daemon=True)
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
        return self._thread is not None

    def _deliver(self, out: RequestOutput) -> None:
        target = self._streams.get(out.request_id)
        if target is not None:
            target[0].call_soon_threadsafe(target[1].put_nowait, out)

    def _run_call(self, item) -> None:
        fn, args, reply = item
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            if reply is not None:
                reply[0].call_soon_threadsafe(set_exception, reply[1], exc)
            return
        if reply is not None:
            reply[0].call_soon_threadsafe(set_result, reply[1], result)

    def _loop(self) -> None:
        while True:
            busy = self._busy()
            try:
                item = self._calls.get(block=not busy, timeout=None)
            except queue.Empty:
                item = False
            while item is not False:
                if item is None:
                    if self._stopping:
                        return
                else:
                    self._run_call(item)
                try:
                    item = self._calls.get_nowait()
                except queue.Empty:
                    item = False
            if not self._busy():
                continue
            try:
                outputs = self._step()
            except Exception as exc:  # noqa: BLE001 - the engine is gone: fail everything held
                log.exception("engine step failed")
                self._fail_all(f"{type(exc).__name__}: {exc}")
                continue
            for out in outputs:
                self._on_output(out)
            if not outputs:
                time.sleep(IDLE_POLL_S)  # waiting for KV to arrive or a release: do not spin the core

    def _fail_all(self, error: str) -> None:
        for rid in list(self._streams):
            self._deliver(RequestOutput(rid, [], finished=True, finish_reason="abort", error=error))
        for rid, (loop, fut) in list(self._firsts.items()):
            loop.call_soon_threadsafe(set_exception, fut, RuntimeError(error))
        self._firsts.clear()

    # ---- asyncio side ----
    async def _stream(self, request_id: str, fn, *args) -> AsyncIterator[RequestOutput]:
        if self._thread is None:
            raise RuntimeError("VllmAsyncEngine is not started (await start() first)")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        try:
            await self._call(fn, *args)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finished = False
        try:
            while not finished:
                out = await q.get()
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished and self._thread is not None:
                self._calls.put((self._abort, (request_id,), None))

    async def _call(self, fn, *args):
        if self._thread is None:
            raise RuntimeError("VllmAsyncEngine is not started (await start() first)")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._calls.put((fn, args, (loop, fut)))
        return await fut


def set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
