"""AsyncLLMEngine: the LLMEngine on one background thread, driven from asyncio; the built-in
implementation of ``server_engine.py: ServerEngine``, what the prefill and decode servers call.

Each call runs on the engine thread (LLMEngine is not thread-safe) and is there the LLMEngine's
own method (``add_request``, ``abort``) or its P/D primitive (``engine.pd``: ``pd_hooks.py``),
with nothing in between. Coroutines submit work through a thread-safe queue and get results
through asyncio futures/queues (the queue, the calls and the output streams are
engine_thread.py's). The thread runs ``step()`` whenever requests are running and sleeps on the
queue otherwise.

Lifecycle and who frees what:
- ``generate`` / ``add_prefilled`` stream RequestOutputs until one is finished. If the consumer
  stops iterating early (break, cancellation, client gone) the request is aborted and its
  blocks freed.
- ``prefill_only`` queues a remote prefill (``engine.pd.add_remote``), which the engine's one
  scheduler chunks and batches with everything else, and resolves with its first token; it then
  holds the prompt's blocks until ``release`` (or ``abort``). The first token's
  and the prompt's logprobs, when its sampling asks for them, are read in the same engine call
  and kept here until then: ``prefill_logprob`` / ``prefill_prompt_logprobs`` answer without a
  trip to the engine thread, which by then is usually computing the next prompt (a trip would
  hold this request's first token until that prompt is done). So do the prompt tokens its prefix
  cache held (``prefill_cached_tokens``: the request's ``usage.prompt_tokens_details.cached_tokens``).
- ``reserve`` / ``reserve_prefix`` hold blocks until ``add_prefilled``'s (or
  ``prefill_reserved``'s) stream ends, or ``abort``.
- If a step raises, every running request's stream ends with a RequestOutput whose
  ``finish_reason`` is "abort" and ``error`` names the exception; their blocks are freed.
- ``stop()`` aborts everything still held and joins the thread.

Reads from any thread (e.g. the event loop's metrics and admission checks), without a round
trip to the engine thread:
- ``num_blocks``: the pool's size in blocks (constant).
- ``num_free_blocks()``: the free blocks as the engine thread last published them, under a
  lock. It publishes after every call it runs (before that call's awaiter resumes) and after
  every step (before that step's outputs are delivered), so a coroutine sees at least the
  effect of its own awaited calls; the value may lag the engine by at most the step or
  call now running.
- ``num_requests()``: requests holding engine state, published the same way.
- ``prefill_counters()``: (prompt tokens computed by prefill_only, seconds), the same way.
- ``swapped()``: (requests swapped out to host memory, their bytes), the same way.
- ``tier_stats()``: the KV tiers' running totals (hits, bytes, time), the same way.
- ``busy_seconds()``: seconds the engine thread spent in steps since start, the step in progress up to
  now (``busy_clock.py``): one engine core, so steps never overlap and its growth over a window is at most
  the window (the planner's prefill utilisation; for ``--engine sim`` the steps' modelled sleeps count).
Never touch ``engine`` (the LLMEngine) itself from another thread; a plain thread (not the
event loop) runs an engine call on the engine thread with ``call_blocking`` (kvpool's lender
and pooled requests in a decode do).

``trace`` (with ``EngineConfig.step_trace``): a ``StepTrace`` (step_trace.py) the thread fills, one record per
step: what ran in and just before it (the calls, collections, other threads' CPU, the batch); None when off.

``after_step`` (optional, set before ``start``): called on the engine thread after every
step as ``after_step(engine, seconds, batch_size)``, and every ``SWAP_POLL_S`` while only
swapped-out requests are left (seconds 0, batch 0) - the decode's LSO controller evicts and
restores there (``swap.py``), between steps.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, AsyncIterator, Callable

from .busy_clock import BusyClock
from .engine_thread import EngineThread, set_exception, set_result
from .errors import TensorParallelError
from .sampling_params import SamplingParams
from .sequence import RequestOutput
from .step_trace import StepTrace

if TYPE_CHECKING:
    from .llm_engine import LLMEngine

log = logging.getLogger(__name__)
SWAP_POLL_S = 0.02  # while only swapped-out requests are left: how often after_step may restore them
STALL_POLL_S = 0.005  # while waiting requests fit no free blocks: how often to try again without a call


class AsyncLLMEngine(EngineThread):
    def __init__(self, engine: LLMEngine):
        """``engine``: an LLMEngine, or the simulated engine (``sim/engine.py``'s SimEngine: the same EngineCore
        and the members this thread reads: ``kv_cache.block_nbytes``, ``swapper``, ``tiers``)."""
        super().__init__()
        self.engine = engine
        self._num_blocks = engine.num_blocks
        self._published = threading.Lock()  # guards the published counts below
        self._free_blocks = engine.num_free_blocks()
        self._num_requests = engine.num_requests()
        self._prefix_hit_tokens = engine.prefix_hit_tokens()
        self._prefill_counters = engine.pd.prefill_counters
        self._swapped = (0, 0)
        # request id -> (first token's TokenLogprob, prompt logprobs) of a held prefill_only request
        # that asked for either; written on the engine thread before prefill_only's awaiter resumes
        self._prefill_logprobs: dict[str, tuple] = {}
        self._prefill_cached: dict[str, int] = {}  # request id -> prompt tokens its prefix cache held (held requests)
        self.after_step: Callable[[LLMEngine, float, int], None] | None = None
        self.step_floor_s = 0.0  # a test hook (pdserve/test_hooks.py, set by the wiring): every step lasts this long
        # called on the engine thread when a step raised TensorParallelError (a rank died or hung: the engine can
        # never step again), after the running requests failed; a server sets it to exit (server_setup.py)
        self.on_lost: Callable[[BaseException], None] | None = None
        self._lost_reported = False  # on_lost was called
        self._tier_stats = engine.tier_stats()
        self._busy_clock = BusyClock()  # seconds in steps (the thread's own: steps never overlap)
        # debug: what happened in and just before each step (step_trace.py), with EngineConfig.step_trace
        self.trace: StepTrace | None = None
        if getattr(engine.config, "step_trace", 0):
            self.trace = StepTrace(engine.config.step_trace)

    # ---- thread-safe reads (no engine-thread round trip) -----------------------------------
    @property
    def num_blocks(self) -> int:
        """KV blocks in the pool (constant)."""
        return self._num_blocks

    def num_free_blocks(self) -> int:
        """Free KV blocks as last published by the engine thread (see the module docstring)."""
        with self._published:
            return self._free_blocks

    def num_requests(self) -> int:
        """Requests holding engine state (waiting, running, held, reserved), as last published."""
        with self._published:
            return self._num_requests

    def prefix_hit_tokens(self) -> int:
        """Prompt tokens whose KV came from the prefix cache since start (a counter), as last published."""
        with self._published:
            return self._prefix_hit_tokens

    def tier_stats(self) -> dict:
        """KV tier name -> its TierStats (engine/kv_tiers.py), as last published; empty without tiers."""
        with self._published:
            return self._tier_stats

    def prefill_counters(self) -> tuple[int, float]:
        """(prompt tokens prefill_only computed, seconds of their forward passes), as last published."""
        with self._published:
            return self._prefill_counters

    def swapped(self) -> tuple[int, int]:
        """(requests swapped out to host memory, their bytes), as last published."""
        with self._published:
            return self._swapped

    def busy_seconds(self) -> float:
        """Seconds the engine thread spent in steps since start, the step in progress up to now."""
        return self._busy_clock.seconds()

    # ---- colocated -------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Errors of add_request (bad input, too long) raise here."""
        async for out in self._stream(request_id, self.engine.add_request, request_id, prompt_token_ids, sampling):
            yield out

    async def abort(self, request_id: str) -> bool:
        return await self._call(self._abort, request_id)

    # ---- P/D -------------------------------------------------------------------------------
    async def prefill_only(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        on_layer: Callable[[int, list[int], int], None] | None = None,
        want: Callable[[], None] | None = None,
    ) -> int:
        """A remote prefill (``engine.pd.add_remote``), scheduled with every other request in the order the
        calls came (the prefill's admission line already put them in its SLO policy's order); its first
        token. ``on_layer(layer, block_ids, first)`` is called on the engine thread as each chunk's layer
        is written. With ``want``, it is computed only after ``grant(request_id)``: ``want()`` is called (on
        the event loop) once the Scheduler would compute it. Cancelling the wait aborts the request (its blocks
        freed)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        on_done = self._prefill_done(request_id, sampling, loop, fut)
        on_want = None if want is None else (lambda: loop.call_soon_threadsafe(want))
        try:  # a cancel while the add is queued too: the abort goes on the queue after it (the queue keeps order)
            await self._call(self.engine.pd.add_remote, request_id, prompt_token_ids, sampling, on_layer, on_done,
                             0.0, on_want)
            return await fut
        except asyncio.CancelledError:
            self._calls.put((self._abort, (request_id,), None))
            raise

    async def grant(self, request_id: str) -> bool:
        """A ``prefill_only`` request given ``want`` may be computed now (``engine.pd.grant``)."""
        return await self._call(self.engine.pd.grant, request_id)

    async def prefill_logprob(self, request_id: str):
        """The first token's TokenLogprob of a held prefill_only request (None unless it asked)."""
        if request_id in self._prefill_logprobs:
            return self._prefill_logprobs[request_id][0]
        return await self._call(self.engine.pd.prefill_logprob, request_id)

    async def prefill_prompt_logprobs(self, request_id: str) -> list | None:
        """The prompt logprobs of a held prefill_only request (None unless it asked ``prompt_logprobs``)."""
        if request_id in self._prefill_logprobs:
            return self._prefill_logprobs[request_id][1]
        return await self._call(self.engine.pd.prefill_prompt_logprobs, request_id)

    def prefill_cached_tokens(self, request_id: str) -> int:
        """The prompt tokens of a held prefill_only request that the prefix cache held (0 once released)."""
        return self._prefill_cached.get(request_id, 0)

    async def release(self, request_id: str) -> None:
        self._prefill_logprobs.pop(request_id, None)
        self._prefill_cached.pop(request_id, None)
        await self._call(self.engine.pd.release, request_id)

    async def reserve(self, request_id: str, num_prompt_tokens: int, max_tokens: int) -> list[int]:
        return await self._call(self.engine.pd.reserve, request_id, num_prompt_tokens, max_tokens)

    async def reserve_prefix(self, request_id: str, prompt_token_ids: list[int],
                             max_tokens: int) -> tuple[list[int], int]:
        return await self._call(self.engine.pd.reserve_prefix, request_id, prompt_token_ids, max_tokens)

    async def add_prefilled(
        self, request_id: str, prompt_token_ids: list[int], first_token_id: int, sampling: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Join a reserved request to the batch and stream the tokens after the first one."""
        async for out in self._stream(request_id, self.engine.pd.add_prefilled, request_id, prompt_token_ids,
                                      first_token_id, sampling):
            yield out

    async def prefill_reserved(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Compute a reserved request's missing prompt KV here, then decode: streams every token."""
        async for out in self._stream(request_id, self.engine.pd.prefill_reserved, request_id, prompt_token_ids,
                                      sampling):
            yield out

    async def stats(self) -> dict:
        """Free/total blocks and request counts, read on the engine thread."""

        def read():
            e = self.engine
            return {
                "num_free_blocks": e.num_free_blocks(),
                "num_blocks": e.num_blocks,
                "block_nbytes": e.kv_cache.block_nbytes,
                "num_running": len(e.running),
                "num_waiting": len(e.waiting),
                "num_requests": e.num_requests(),
            }

        return await self._call(read)

    # ---- internals (the engine thread: engine_thread.py) -------------------------------------
    def _abort(self, request_id: str) -> bool:
        self._prefill_logprobs.pop(request_id, None)
        self._prefill_cached.pop(request_id, None)
        return self.engine.abort(request_id)

    def _prefill_done(self, request_id: str, sampling: SamplingParams, loop: asyncio.AbstractEventLoop,
                      fut: asyncio.Future):
        """A remote prefill's ``on_done`` (engine thread): what its held request's reads answer, then its
        awaiter resumes."""
        def on_done(token: int | None, error: BaseException | None) -> None:
            if error is not None:
                loop.call_soon_threadsafe(set_exception, fut, error)
                return
            pd = self.engine.pd
            self._prefill_cached[request_id] = pd.prefill_cached_tokens(request_id)
            if sampling.logprobs is not None or sampling.prompt_logprobs is not None:
                self._prefill_logprobs[request_id] = (pd.prefill_logprob(request_id),
                                                      pd.prefill_prompt_logprobs(request_id))
            self._publish()  # the awaiter reads the prefill counters next
            loop.call_soon_threadsafe(set_result, fut, token)
        return on_done

    def _publish(self) -> None:
        """On the engine thread: make the engine's counts readable from other threads."""
        e = self.engine
        free, requests, hits, counters = (e.num_free_blocks(), e.num_requests(), e.prefix_hit_tokens(),
                                          e.pd.prefill_counters)
        swapped = (len(e.swapper.swapped_ids()), e.swapper.swapped_bytes())
        tiers = e.tier_stats() if e.tiers is not None else self._tier_stats
        with self._published:
            self._tier_stats = tiers
            self._free_blocks, self._num_requests = free, requests
            self._prefix_hit_tokens, self._prefill_counters, self._swapped = hits, counters, swapped

    def _abort_all(self) -> None:
        self.engine.abort_all()
        for rid in list(self._streams):  # open streams end instead of waiting forever
            self._deliver(RequestOutput(rid, [], True, "abort", error="engine stopped"))

    def _lost_in_call(self) -> bool:
        """A call (not a step) found the tensor-parallel ranks lost (``add_prefilled``'s scatter: tp/transfer.py):
        fail what runs and call ``on_lost`` once, as a failed step does; True then."""
        lost = getattr(self.engine, "tensor_parallel_lost", None)
        if lost is None or self.on_lost is None or self._lost_reported:
            return False
        self._lost_reported = True
        for out in self.engine.fail_scheduled(str(lost)):
            self._deliver(out)
        self.on_lost(lost)
        return True

    def _loop(self) -> None:
        e = self.engine
        while True:
            idle = not e.has_unfinished()
            poll = idle and self.after_step is not None and bool(e.scheduler.swapped)
            # work is waiting but the last step could schedule none of it (no free blocks): wait for a call
            # (a release, an abort) instead of spinning, a little at a time
            stalled = not idle and e.stalled
            try:
                item = self._calls.get(block=idle or stalled,
                                       timeout=SWAP_POLL_S if poll else STALL_POLL_S if stalled else None)
            except queue.Empty:
                item = False
            if item is None and self._stopping:
                return
            if item:
                if not self._run_calls(item):
                    return
                if self._lost_in_call():
                    continue
            if not e.has_unfinished():
                if poll:
                    self._after_step(0.0, 0)
                    self._publish()
                continue
            self._step()

    def _run_calls(self, item) -> bool:
        """Run ``item`` and every call queued behind it, before the next step; False: stop (``stop()``)."""
        started, count = time.perf_counter(), 0
        while True:
            if item is None:
                if self._stopping:
                    return False
            else:
                self._run_call(item)
                count += 1
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
        if self.trace is not None:
            self.trace.calls_done(count, time.perf_counter() - started)
        return True

    def _step(self) -> None:
        """One engine step, then ``after_step``, the published counts and the outputs delivered."""
        e, trace = self.engine, self.trace
        batch = len(e.running)
        start = time.perf_counter()
        self._busy_clock.begin()
        if trace is not None:
            trace.begin()
        try:
            outputs = e.step()
        except Exception as exc:  # fail every running request, keep serving
            outputs = e.fail_scheduled(f"{type(exc).__name__}: {exc}")
            if isinstance(exc, TensorParallelError) and self.on_lost is not None:
                self._busy_clock.end()
                for out in outputs:
                    self._deliver(out)
                self._lost_reported = True
                self.on_lost(exc)
                return
        if trace is not None:
            trace.stepped(e.last_shape, len(e.scheduler.reserved), len(e.scheduler.joining))
        if self.step_floor_s > time.perf_counter() - start:  # test hook: steps a test can count on any CPU
            time.sleep(self.step_floor_s - (time.perf_counter() - start))
        self._busy_clock.end()
        self._after_step(time.perf_counter() - start, batch)
        self._publish()
        for out in outputs:
            self._deliver(out)

    def _after_step(self, seconds: float, batch: int) -> None:
        if self.after_step is None:
            return
        try:
            self.after_step(self.engine, seconds, batch)
        except Exception:  # noqa: BLE001 - a policy bug must not stop the engine
            log.exception("after_step failed")
