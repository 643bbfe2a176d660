"""BatchRunner: moves every unfinished batch along and runs its lines through the node.

One asyncio task (``_loop``) wakes on every change (a batch created or cancelled, a line
finished) and at least every ``poll_s`` seconds, and for each unfinished batch, oldest
first:

- ``validating``: reads the input file, splits it into lines (``lines.split_lines``:
  bad lines become error lines at once) and stores them -> ``in_progress``; an input with
  no line at all -> ``failed``;
- ``in_progress``: starts pending lines while fewer than ``max_in_flight`` lines (of all
  batches) are in flight, so online requests always find room; each line is one request
  through ``Frontend.stream`` - the same admission queue, decode choice and deadline as an
  online request, in the batch SLO class - and its answer (any status: 2xx to the output
  file, others to the error file) is recorded in one transaction with the line's
  completion. A line refused only for being early (429 queue full, 503 no decode) stays
  pending and runs again after ``retry_s``. No pending line and none in flight ->
  ``finalizing`` -> ``completed`` (output and error files written). Past ``expires_at``:
  in-flight lines are cancelled, the pending ones become ``batch_expired`` error lines ->
  ``expired``;
- ``cancelling``: its in-flight lines are cancelled (they free everything they held, like
  a client that disconnects) -> ``cancelled``, with the files of the lines that finished;
- ``finalizing`` (found after a restart): the files are written -> its final status.

After a restart every unfinished batch resumes where the database says: lines that were in
flight are still pending and run again; a finished line is never run or written twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pdserve.prefill_server.openai_api as oa
from pdserve.prefill_server.closing import aclose_fully
from pdserve.prefill_server.http_api import FAILURE_TYPES, failure
from pdserve.prefill_server.openai_serving import start, whole

from .lines import split_lines
from .store import BatchStore, response_line

log = logging.getLogger(__name__)

RETRY_STATUSES = (429, 503)  # the server had no room yet: the line runs again later


class StoreThread:
    """The BatchStore called from one worker thread (SQLite work never blocks the event loop)."""

    def __init__(self, store: BatchStore):
        self.store = store
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="batch-store")

    async def __call__(self, method: str, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, partial(getattr(self.store, method), *args))

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.store.close()


async def execute(frontend, slo_class, url: str, body: dict) -> tuple[int, str, dict]:
    """One batch line as a non-streamed request: (status code, request id, response body),
    the same answer the HTTP API would give the same body (every choice, logprobs, tools)."""
    fe = frontend
    parse = oa.parse_chat if url == "/v1/chat/completions" else oa.parse_completion
    try:
        parsed = parse(body, fe.model_name, fe.max_model_len, fe.vocab_size)
        n_prompt, states, pieces = start(fe, parsed, slo_class, None)
    except oa.BadRequest as exc:
        return 400, "", oa.error_body(exc.message, "invalid_request_error", exc.param, exc.code)
    rid = parsed.request_id
    try:
        try:
            first = await pieces.__anext__()
        except StopAsyncIteration:
            return 502, rid, oa.error_body("the request ended without a finish", "server_error", code="decode_failed")
        status, out = await whole(parsed, states, n_prompt, first, pieces)
        return status, rid, out
    except FAILURE_TYPES as exc:
        status, type_, code = failure(exc)
        return status, rid, oa.error_body(str(exc), type_, code=code)
    except oa.BadRequest as exc:  # a choice's request id already in flight
        return 400, rid, oa.error_body(exc.message, "invalid_request_error", exc.param, exc.code)
    finally:
        await aclose_fully(pieces)


class BatchRunner:
    def __init__(self, store: StoreThread, run_line, max_in_flight: int, clock=time.time, poll_s: float = 0.5,
                 retry_s: float = 1.0):
        """``run_line(url, body) -> (status, request_id, body)`` (``execute`` bound to a frontend)."""
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.store, self.run_line, self.max_in_flight = store, run_line, max_in_flight
        self.clock, self.poll_s, self.retry_s = clock, poll_s, retry_s
        self.tasks: dict[tuple[str, int], asyncio.Task] = {}  # (batch id, line number) -> the line's task
        self.retry_at: dict[tuple[str, int], float] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.lines_run = 0  # lines recorded by this process (tests, /health)

    def start(self) -> None:
        self._stopping = False
        self._task = asyncio.create_task(self._loop(), name="batch-runner")

    def wake(self) -> None:
        self._wake.set()

    def state(self) -> dict:
        return {"lines_in_flight": len(self.tasks), "lines_run": self.lines_run, "max_in_flight": self.max_in_flight}

    async def stop(self) -> None:
        """Stop starting lines and cancel those in flight (they stay pending and run after a restart)."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        tasks = list(self.tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug or a full disk: say so, keep serving, try again
                log.exception("batch runner step failed")
            if self._stopping:
                return
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the inner result when the
            # event is set in the same turn as the task's cancel (wake() then stop()), losing the
            # cancellation, and stop() waited for ever
            try:
                async with asyncio.timeout(self.poll_s):
                    await self._wake.wait()
            except TimeoutError:
                pass

    def _in_flight(self, batch_id: str) -> list[asyncio.Task]:
        return [t for (bid, _), t in self.tasks.items() if bid == batch_id]

    async def step(self) -> None:
        """One pass over the unfinished batches (see the module docstring)."""
        for batch in await self.store("unfinished"):
            bid, status, now = batch["id"], batch["status"], int(self.clock())
            if status == "validating":
                await self._validate(batch, now)
            elif status == "cancelling":
                for t in self._in_flight(bid):
                    t.cancel()
                if not self._in_flight(bid):
                    await self._finish(bid, now)
            elif status == "finalizing":
                await self._finish(bid, now)
            elif now >= batch["expires_at"]:
                for t in self._in_flight(bid):
                    t.cancel()
                await self.store("finalizing", bid, "expired", now,
                                 {"code": "batch_expired", "message": "the batch expired before this request ran"})
                await self._finish(bid, now)
            else:
                await self._dispatch(bid, batch["endpoint"], now)

    async def _finish(self, bid: str, now: int) -> None:
        done = await self.store("finish", bid, now)
        for key in [k for k in self.retry_at if k[0] == bid]:
            del self.retry_at[key]
        log.info("batch %s %s: %s", bid, done["status"], done["request_counts"])

    async def _validate(self, batch: dict, now: int) -> None:
        bid = batch["id"]
        content = await self.store("file_content", batch["input_file_id"])
        if content is None:
            await self.store("fail", bid, [{"code": "file_not_found", "message": f"input file {batch['input_file_id']} "
                                            "no longer exists", "param": "input_file_id", "line": None}], now)
            return
        lines = await asyncio.to_thread(split_lines, content, batch["endpoint"])
        if not lines:
            await self.store("fail", bid, [{"code": "empty_file", "message": "the input file has no lines",
                                            "param": "input_file_id", "line": None}], now)
            return
        if await self.store("start", bid, lines, now):
            log.info("batch %s in progress: %d lines, %d bad", bid, len(lines), sum(e is not None for _, _, e in lines))
            self.wake()

    async def _dispatch(self, bid: str, endpoint: str, now: int) -> None:
        free = self.max_in_flight - len(self.tasks)
        mono = time.monotonic()
        waiting = {n for (b, n), t in self.retry_at.items() if b == bid and t > mono}
        if free > 0:
            busy = {n for (b, n) in self.tasks if b == bid}
            for line_no, custom_id, body in await self.store("pending_lines", bid, free, busy | waiting):
                key = (bid, line_no)
                self.retry_at.pop(key, None)
                self.tasks[key] = asyncio.create_task(self._line(key, endpoint, custom_id, body),
                                                      name=f"batch-line-{bid}-{line_no}")
        if not self._in_flight(bid) and not waiting and await self.store("count_pending", bid) == 0:
            await self.store("finalizing", bid, "completed", now)
            await self._finish(bid, now)

    async def _line(self, key: tuple[str, int], endpoint: str, custom_id: str, body: str) -> None:
        try:
            try:
                status, rid, answer = await self.run_line(endpoint, json.loads(body))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug: the line gets a 500, the batch goes on
                log.exception("batch line %s failed", key)
                status, rid, answer = 500, "", oa.error_body(f"internal error: {exc}", "server_error",
                                                             code="internal_error")
            if status in RETRY_STATUSES:
                self.retry_at[key] = time.monotonic() + self.retry_s
                return
            if await self.store("record", key[0], key[1], 200 <= status < 300,
                                response_line(custom_id, status, rid, answer)):
                self.lines_run += 1
        finally:
            self.tasks.pop(key, None)
            self.wake()
