"""PipelineExecutor: Batch API lines run on the pipeline engine (throughput mode, TD-Pipe).

The ``BatchRunner`` (``runner.py``) keeps deciding which lines run and records each
answer exactly once in SQLite; this executor is its ``run_line`` when the server runs batch
jobs for throughput (``pdserve batch-server``) instead of through the online path:

    executor = PipelineExecutor("tiny", PipelineConfig(num_stages=2, schedule="td-pipe"))
    await executor.start()                 # spawns the stages (model load), in its own thread
    status, request_id, body = await executor.execute("/v1/chat/completions", body)
    await executor.stop()

One thread owns the ``PipelineEngine`` (it creates it, so the stages it spawns die with it:
``stage.py``'s parent-death signal) and loops: take the lines added since the last step,
``engine.step()`` (one micro-batch back), hand each finished request's output to the
awaiting coroutine. Many lines are in the engine at once (the runner's ``max_in_flight``),
so TD-Pipe's prefill phases and decode phases see whole batches, not a trickle.

A line whose task is cancelled (batch cancelled, server stopping) is dropped from the engine
when it has not started; a started one runs to its end and its output is ignored. Bodies
are parsed like ``pdserve batch`` does (``pipeline/cli.py``'s ``parse_body``): a bad body is
a 400 error line; a request the engine refuses (longer than the KV pool) too. If the engine
dies (a stage crashed), every line in it and every later one answers 503: the runner keeps
them pending, and a restarted server runs them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading

import pdserve.prefill_server.openai_api as oa

from .pipeline.cli import parse_body, response_body
from .pipeline.engine import PipelineConfig, PipelineEngine
from .pipeline.meta import load_meta

log = logging.getLogger(__name__)

_STOP = object()


class EngineDown(RuntimeError):
    pass


class PipelineExecutor:
    def __init__(self, model: str, config: PipelineConfig, model_name: str | None = None):
        self.model, self.config = model, config
        self.model_name = model_name or model
        self.tokenizer = load_meta(model).tokenizer
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name="pipeline-executor", daemon=True)
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self.lines_in_engine = 0  # added, not answered (the engine thread's count; /health)
        self.schedule_name = config.schedule

    # ---- the event loop's side -------------------------------------------------------------
    async def start(self) -> None:
        self._thread.start()
        await asyncio.to_thread(self._started.wait)
        if self._error is not None:
            raise self._error

    async def stop(self) -> None:
        self._inbox.put(_STOP)
        await asyncio.to_thread(self._thread.join, 120)

    def state(self) -> dict:
        return {"executor": "pipeline", "schedule": self.schedule_name, "stages": self.config.num_stages,
                "lines_in_engine": self.lines_in_engine,
                "engine_error": None if self._error is None else str(self._error)}

    async def execute(self, url: str, body: dict) -> tuple[int, str, dict]:
        """One batch line: (status code, request id, response body) as the runner records it."""
        try:
            ids, sampling = parse_body(url, body, self.tokenizer)
        except ValueError as exc:
            return 400, "", oa.error_body(str(exc), "invalid_request_error", code="invalid_request")
        if body.get("stream"):
            return 400, "", oa.error_body("stream is not supported in a batch", "invalid_request_error", "stream")
        if self._error is not None:
            return 503, "", oa.error_body(f"the pipeline engine is down: {self._error}", "server_error",
                                          code="engine_down")
        rid = f"batchline-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put(("add", rid, ids, sampling, future, loop))
        try:
            out = await future
        except asyncio.CancelledError:
            self._inbox.put(("abort", rid))
            raise
        except EngineDown as exc:
            return 503, rid, oa.error_body(str(exc), "server_error", code="engine_down")
        except (ValueError, RuntimeError) as exc:  # refused by the engine (too long for the pool)
            return 400, rid, oa.error_body(str(exc), "invalid_request_error", code="invalid_request")
        return 200, rid, response_body(url, rid, self.model_name, out.text, out.finish_reason, len(ids),
                                       len(out.new_token_ids))

    # ---- the engine thread -----------------------------------------------------------------
    def _main(self) -> None:
        try:
            engine = PipelineEngine(self.model, self.config)
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._error = exc
            self._started.set()
            return
        self._started.set()
        waiting: dict[str, tuple[asyncio.Future, asyncio.AbstractEventLoop]] = {}
        try:
            while self._take(engine, waiting, block=not engine.has_work()):
                if not engine.has_work():
                    continue
                for out in engine.step():
                    self._answer(waiting.pop(out.request_id, None), out)
                self.lines_in_engine = len(waiting)
            engine.close()
        except BaseException as exc:  # noqa: BLE001 - a stage died: every waiting line learns it
            log.exception("pipeline engine failed")
            self._error = exc
            for entry in waiting.values():
                self._answer(entry, EngineDown(f"the pipeline engine failed: {exc}"))
            waiting.clear()
            engine.__exit__(type(exc), exc, None)
        finally:
            self.lines_in_engine = 0

    def _take(self, engine, waiting: dict, block: bool) -> bool:
        """Apply what the event loop sent (adds, aborts); False on stop."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if item is _STOP:
                for entry in waiting.values():
                    self._answer(entry, EngineDown("the server is stopping"))
                waiting.clear()
                return False
            if item[0] == "add":
                _, rid, ids, sampling, future, loop = item
                try:
                    engine.add_request(rid, ids, sampling)
                    waiting[rid] = (future, loop)
                except (ValueError, RuntimeError) as exc:
                    self._answer((future, loop), exc)
            elif item[0] == "abort":
                engine.abort(item[1])  # a started request runs on; its output is dropped
                waiting.pop(item[1], None)
            self.lines_in_engine = len(waiting)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    @staticmethod
    def _answer(entry, result) -> None:
        if entry is None:
            return
        future, loop = entry

        def settle():
            if future.done():
                return
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

        loop.call_soon_threadsafe(settle)
