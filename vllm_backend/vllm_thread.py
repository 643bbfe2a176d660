"""VllmEngineThread: the engine thread (pdserve.engine.engine_thread) stepping vLLM's engine.

The thread takes every queued call, then steps vLLM (``_step``) while it is busy (``_busy``:
requests, or held blocks to report freed), hands each output to ``_on_output``, and sleeps on
the queue otherwise; a step with no output (waiting for KV to arrive or a release) rests
``IDLE_POLL_S``. A step that raises fails every request held (``_fail_all``): open streams end
with an error, and so do the first-token futures of prefill requests (``_firsts``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time

from pdserve.engine.engine_thread import EngineThread, set_exception
from pdserve.engine.sequence import RequestOutput

log = logging.getLogger(__name__)
IDLE_POLL_S = 0.002


class VllmEngineThread(EngineThread):
    THREAD_NAME = "vllm-engine"

    def __init__(self):
        super().__init__()
        self._firsts: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}

    def _step(self) -> list:
        raise NotImplementedError

    def _busy(self) -> bool:
        raise NotImplementedError

    def _on_output(self, out) -> None:
        raise NotImplementedError

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
