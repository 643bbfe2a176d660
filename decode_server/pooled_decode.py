"""PooledDecode: one Session's request served through the KV pool (``pdserve decode --kv-pool``).

When a request's prompt + max_tokens do not fit the blocks free here, a DecodeSession with a
pool (``SessionDeps.pool``) takes this path instead of the engine's reservation:

1. **open** (at admission, off the event loop): ``DecodePool.open`` reserves the local blocks
   (every generated token and as many whole blocks of the prompt as fit) and borrows the rest
   from lenders (kvpool/decode_pool.py); each lender's CacheStore receiver expects its part
   (``targets``). (If the pool is a block short for that, the prompt part here is not cut to
   whole blocks, and the prompt is computed here, as below.) No room: OutOfBlocksError, refused as ``out_of_blocks`` (transient). The
   Allocation says ``pooled``, with the local prompt blocks (expected by our receiver) and the
   ``pool_targets``: the prefill computes the prompt and pushes each part straight to where it
   lives. When not even one prompt block fits here (``pushed`` False) the Allocation has no
   blocks: prefill answers ComputePrompt and the prompt is computed here (step 2).
2. **KV in** (pushed): after FirstToken and our own blocks' KV, ``kv_arrived`` waits until
   every lender has its part.
3. **tokens**: a thread of its own runs the pooled request (pushed: the decode steps after the
   first token; else the prompt computed here layer by layer with the overflow's KV put on the
   lenders, then the decode steps), greedy, merging the lenders' micro-attention, and hands each
   token to the event loop as it comes; a lender that does not answer ends the stream with
   ``LenderLost`` (its message names the lender).
4. **close** (always, from the session's release step): the thread is told to stop after the
   token it is computing, then every loan is released and the local blocks are freed. A close
   that is cancelled still completes (shielded); a pool opened after its session was
   cancelled is closed as soon as it is made.
"""  # noqa: E501

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, AsyncIterator

from pdserve.engine.errors import OutOfBlocksError
from pdserve.protos import session_pb2 as pb

if TYPE_CHECKING:
    from pdserve.kvpool.decode_pool import DecodePool
    from pdserve.kvpool.pooled import PooledRequest

_BACKGROUND: set[asyncio.Future] = set()  # closes of pools opened after their session was cancelled


async def _in_thread(fn, *args):
    """``fn(*args)`` on a thread of its own (a pooled request may run for minutes: never the
    event loop's small default executor)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def work():
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(lambda e=exc: done.done() or done.set_exception(e))
        else:
            loop.call_soon_threadsafe(lambda r=result: done.done() or done.set_result(r))

    threading.Thread(target=work, name="pdserve-pooled", daemon=True).start()
    return await done


class PooledDecode:
    def __init__(self, pool: DecodePool, request: PooledRequest, targets: list[pb.PoolTarget] | None):
        self.pool, self.request = pool, request
        self.targets = targets  # None: not pushed (the prompt is computed here)
        self._stop = threading.Event()
        self._worker: asyncio.Future | None = None
        self._closed = False

    @property
    def local_blocks(self) -> int:
        return self.request.local_blocks

    @property
    def pushed(self) -> bool:
        return self.targets is not None

    def local_prompt_blocks(self) -> list[int]:
        """Pushed: our blocks that receive the prompt's leading KV, in order."""
        return self.request.table[: self.request.keep // self.pool.engine.block_size]

    @classmethod
    async def open(cls, pool: DecodePool, start: pb.Start, timeout_s: float) -> PooledDecode:
        """Step 1; if the session is cancelled meanwhile, the pool is closed once it is open."""
        bs = pool.engine.block_size

        def work():
            args = (start.request_id, list(start.prompt_token_ids), start.sampling.max_tokens)
            try:
                request = pool.open(*args, aligned=True)
            except OutOfBlocksError:  # whole blocks here leave up to a block more to borrow: try without
                request = pool.open(*args)
            if request.keep < bs or request.keep % bs:  # not one whole prompt block here: computed here
                return request, None
            try:
                return request, [pb.PoolTarget(request_id=entry_id, cachestore_endpoint=reply.cachestore_endpoint,
                                               block_ids=list(reply.block_ids), first_block=loan.start // bs,
                                               kv_token=reply.kv_token)
                                 for loan, entry_id, reply in request.expect_kv(timeout_s)]
            except BaseException:
                pool.close(request)
                raise

        task = asyncio.ensure_future(_in_thread(work))
        try:
            return cls(pool, *(await asyncio.shield(task)))
        except asyncio.CancelledError:
            def close_if_made(t: asyncio.Future) -> None:
                if not t.cancelled() and t.exception() is None:
                    closing = asyncio.ensure_future(_in_thread(pool.close, t.result()[0]))
                    _BACKGROUND.add(closing)
                    closing.add_done_callback(_BACKGROUND.discard)
            task.add_done_callback(close_if_made)
            raise

    async def kv_arrived(self, timeout_s: float) -> None:
        """Step 2 (pushed): every lender has its part of the prompt's KV (LenderLost if not)."""
        await _in_thread(self.request.kv_arrived, timeout_s)

    async def tokens(self, sampling: pb.Sampling, first_token: int | None = None) -> AsyncIterator[int]:
        """Step 3: the token ids as they come (after ``first_token`` when the prefill computed the
        prompt); raises what the pooled request raised."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        stop = self._stop

        def work() -> None:
            gen = self.request.tokens(sampling.ignore_eos, set(sampling.stop_token_ids), first_token)
            try:
                for token in gen:
                    loop.call_soon_threadsafe(q.put_nowait, ("token", token))
                    if stop.is_set():
                        return
            finally:
                gen.close()

        self._worker = asyncio.ensure_future(_in_thread(work))
        self._worker.add_done_callback(lambda f: q.put_nowait(("end", f)))
        while True:
            kind, value = await q.get()
            if kind == "token":
                yield value
            else:
                value.result()  # the pooled request's error, if any
                return

    async def close(self) -> None:
        """Step 4 (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        closing = asyncio.ensure_future(self._close())
        try:
            await asyncio.shield(closing)
        except asyncio.CancelledError:
            pass  # the shielded close still completes on the loop

    async def _close(self) -> None:
        if self._worker is not None:
            try:
                await self._worker  # stops after the token in progress (or a lender's RPC timeout)
            except Exception:  # noqa: BLE001 - its error went to the session already
                pass
        await _in_thread(self.pool.close, self.request)
