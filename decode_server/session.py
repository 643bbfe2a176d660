"""The decode end of the Session stream: one ``DecodeSession`` per request.

Request lifecycle on decode (each step is a method below):

1. **admit** - the first message must be ``Start``; refuse (``Refusal`` with a code and a
   reason, then end the stream) on a protocol version or compatibility mismatch, while
   draining, when prompt + max_tokens exceed the context, when the request needs more
   blocks than the whole pool (``too_large``; these checks are admission.py) or when the
   engine cannot reserve them now (``out_of_blocks``: transient, prefill may wait and retry).
2. **allocate** - the engine reserves the blocks for prompt + max_tokens (a P/D request
   is never preempted later: its blocks are held from here to the end). With
   ``Start.reuse_prefix`` the reservation starts with the longest prefix of the prompt this
   decode's prefix cache holds (``reserve_prefix``): those ``cached_blocks`` are pinned by
   the reservation (no eviction can take them before step 5), whatever the KV events said
   before. The CacheStore receiver is told to expect the OTHER prompt blocks;
   ``Allocation`` (cached_blocks, their block ids, receiver endpoint) goes back to prefill. Or, where the
   prefill pushes per rank (``rank_receivers.py``), every piece's receiver (a rank's, or a slice of a rank's
   heads) expects them and the Allocation lists one ``RankTarget`` per piece; every wait and clean-up below then
   covers every piece's entry.
3. **transfer** - prefill answers with ``FirstToken`` or ``ComputePrompt`` before the
   session timeout (set by prefill in ``Start``, capped by ours).
   ``ComputePrompt``: the CacheStore entry is deleted (no KV comes) and the request joins
   the batch to compute the prompt after its cached blocks here (``prefill_reserved``);
   step 4 then streams every token, the first one included.
   ``FirstToken``: the missing KV layers arrive over the CacheStore while prefill computes
   (the FirstToken comes once every layer was sent); they must be in before the same
   session timeout. KV that fails its
   checksum (``--kv-checksum``) never counts as arrived: the wait fails with ``ChecksumError``
   and prefill gets ``Error`` with code ``kv_checksum_mismatch`` (it resumes the request on
   another decode); the request never joins the batch. Then the CacheStore
   entry is deleted at once: the blocks now belong to the engine alone (they are freed by
   the engine when the request finishes, and may be re-expected for another request).
4. **decode** - after FirstToken the request joins the continuous batch (``add_prefilled``);
   every engine output becomes a ``Tokens`` message, the last one is followed by ``Finish``.
   Once the Finish went out the request counts as served: the prefill closing the session then
   (as it does, at once) is its normal end, even before our engine stream has closed.
   (Test hooks may hold it just before it joins, ``deps.gates.decode``, and just after its Finish,
   ``deps.gates.decode_finish``: pdserve/test_hooks.py.)
5. **release** - always, whatever happened (finish, ``Cancel``/``Error`` from prefill, the
   stream breaking, a timeout, our own error): abort the request in the engine if it is
   still running, release its blocks, delete its CacheStore entry, forget the session.

Who frees what: decode frees its own blocks and CacheStore entry in step 5; it never
relies on prefill to tell it (a dead prefill tells nothing, a frozen one - SIGSTOP, a hung
host - keeps its connection open and tells nothing either: only timers free its requests).

Leases (each wait on prefill has a timer, so step 5 always comes):
- the Start: ``session_timeout_s``;
- the reservation and the expected CacheStore entry (steps 2-3): the FirstToken and every
  KV layer within ``timeout`` = min(Start's ``timeout_s``, ours);
- every message we write (an Allocation, each Tokens): taken by the stream within
  ``session_timeout_s`` (a frozen prefill stops reading; once gRPC flow control is full a
  write would wait forever);
- the whole Session: its gRPC deadline, set by prefill to the request's end-to-end
  deadline; gRPC cancels this call when it passes, whatever prefill does.

With a KV pool (``--kv-pool``), a request whose KV does not fit the blocks free here takes
the pooled path (local blocks plus loans from peers; session_pooled.py, pooled_decode.py).

A DecodeSession is given its collaborators as ``SessionDeps`` (the engine adapter, the
CacheStore receiver, the session registry, the metrics, the limits), never the service. The
stream side (writes with a timer, the reader of prefill's messages, waits that end when
prefill goes away) is ``SessionStream`` (session_stream.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pdserve.cachestore.errors import CHECKSUM_MISMATCH, ChecksumError
from pdserve.engine import blocks_needed
from pdserve.protos import session_pb2 as pb
from pdserve.protos.logprobs import logprob_to_proto
from pdserve.test_hooks import wait_at_gate

from . import admission
from .pooled_decode import PooledDecode
from .rank_receivers import RankArrival
from .registry import SessionInfo
from .session_deps import KVArrival, SessionDeps
from .session_pooled import PooledSteps
from .session_stream import End, SessionEnded

log = logging.getLogger(__name__)

__all__ = ["DecodeSession", "End", "SessionDeps", "SessionEnded"]
_BACKGROUND: set[asyncio.Future] = set()  # releases of reservations made after their session was cancelled

# Test hook (never set it in production; tests/harness/decode_gate.py drives it): a directory. In step 4,
# before a request joins the batch (its KV is in or prefill said ComputePrompt; after a FirstToken the
# client already has that token), it writes ``held.<request id>`` there and waits until a file ``open``
# exists there (then removes its file): the session stays live (/health, load reports, drain count it)
# and holds its blocks, and nothing is decoded, for as long as the test needs, on any CPU. The event
# loop is never blocked; prefill going away cancels the wait. Prefill's relay timer still runs (it
# fails a stream silent for its --session-timeout). Not the pooled path. Unset: one falsy check.


class DecodeSession(PooledSteps):
    """Runs steps 1-5 for one Session call."""

    def __init__(self, context: grpc.aio.ServicerContext, deps: SessionDeps):
        super().__init__(context, deps.metrics, deps.session_timeout_s)
        self.deps = deps
        self.request_id = ""  # the Start's (admission refuses an empty one)
        self.reserved = False
        self.expected = False
        self.kv_in: KVArrival = deps.receiver  # where this request's KV lands: the receiver, or every rank's
        self.arrival: RankArrival | None = None  # the per-rank push's entries (rank_receivers.py), when offered
        self.cached_blocks = 0  # leading prompt blocks reused from our prefix cache
        self.pooled: PooledDecode | None = None  # the pooled path (KV partly on lenders)
        self.info: SessionInfo | None = None
        self.outcome = ("error", "error")  # (outcome, reason) for the requests counter

    # -- the lifecycle -----------------------------------------------------------------------
    async def run(self) -> None:
        deps = self.deps
        reader = arrivals = None
        try:
            async with asyncio.timeout(deps.session_timeout_s):
                first = await self.context.read()
            if first is grpc.aio.EOF or first.WhichOneof("kind") != "start":
                return
            start = first.start
            self.request_id = start.request_id
            info = await self._admit(start)
            if info is None:
                return
            reader = asyncio.ensure_future(self.read_rest())
            timeout = min(start.timeout_s or deps.session_timeout_s, deps.session_timeout_s)
            deadline = time.monotonic() + timeout
            info.stage = "transfer"
            arrivals = asyncio.ensure_future(self._record_layer_arrivals(timeout))
            answer = await self.until_peer_gone_or(self.answer, timeout, "the first token")
            if self.pooled is not None and self.pooled.pushed != isinstance(answer, pb.FirstToken):
                raise SessionEnded(f"a pooled request's Allocation {'listed' if self.pooled.pushed else 'had no'} "
                                   f"blocks to push into: prefill must answer "
                                   f"{'FirstToken' if self.pooled.pushed else 'ComputePrompt'}")
            if self.pooled is not None and not self.pooled.pushed:
                info.stage = "decode"
                await self.until_peer_gone_or(self._decode_pooled(self.pooled, start), None, "decoding")
                return
            n_blocks = blocks_needed(len(start.prompt_token_ids), deps.compat.block_size)
            if isinstance(answer, pb.ComputePrompt):
                await self._stop_receiving()
                deps.metrics.prompt_blocks(reused=self.cached_blocks, computed=n_blocks - self.cached_blocks)
                log.info("session %s: computing the prompt here (%d of %d blocks cached): %s", self.request_id,
                         self.cached_blocks, n_blocks, answer.reason)
                info.stage = "decode"
                await self.until_peer_gone_or(self._decode(start, None), None, "decoding")
                return
            remaining = max(0.01, deadline - time.monotonic())
            await self.until_peer_gone_or(self.kv_in.wait_all(self.request_id, remaining), remaining + 0.5,
                                          "the KV layers")
            # The KV is in the blocks: unpin the CacheStore entry now, before the engine can
            # finish the request and hand its blocks to another request's expect().
            self.kv_in.delete(self.request_id)
            self.expected = False
            if self.pooled is not None:  # the lenders' parts too
                remaining = max(0.01, deadline - time.monotonic())
                await self.until_peer_gone_or(self._pooled_kv_in(self.pooled, remaining), remaining + 1.0,
                                              "the lenders' KV")
            deps.metrics.kv_in(time.monotonic() - info.started, moved=n_blocks - self.cached_blocks,
                               reused=self.cached_blocks)
            if answer.finished:
                await self.write_finish(answer.finish_reason or "stop", 1)
                self.outcome = ("ok", answer.finish_reason or "stop")
                return
            info.stage = "decode"
            if self.pooled is not None:
                await self.until_peer_gone_or(self._decode_pooled(self.pooled, start, answer.token_id), None,
                                              "decoding")
                return
            await self.until_peer_gone_or(self._decode(start, answer.token_id), None, "decoding")
        except SessionEnded as exc:
            if self.outcome[0] == "ok" and not exc.notify:
                # the Finish went out: the prefill closing the session after it is the request's normal end,
                # also when it comes before our engine stream has closed
                log.debug("session %s: %s after its Finish", self.request_id, exc.reason)
            else:
                log.info("session %s ended: %s", self.request_id, exc.reason)
                self.outcome = exc.end.labels
            if exc.notify:
                await self.try_write_error(exc.reason)
        except ChecksumError as exc:  # the KV arrived corrupted: never decode on it (counted by the receiver hook)
            log.warning("session %s: %s", self.request_id, exc)
            self.outcome = ("error", CHECKSUM_MISMATCH)
            await self.try_write_error(str(exc), CHECKSUM_MISMATCH)
        except asyncio.CancelledError:
            if self.outcome[0] != "ok":  # the RPC ended before the Finish went out (or while it did)
                self.outcome = self.cancelled_labels()
            raise
        except asyncio.TimeoutError:
            log.info("session: no Start within %.1fs", deps.session_timeout_s)
        except Exception as exc:  # the engine or the receiver failed: tell prefill, then clean up
            log.exception("session %s failed", self.request_id)
            await self.try_write_error(f"decode failed: {type(exc).__name__}: {exc}")
        finally:
            if reader is not None:
                reader.cancel()
            if arrivals is not None:
                arrivals.cancel()
            await self._release()

    async def _record_layer_arrivals(self, timeout: float) -> None:
        """Monotonic time each KV layer arrived (subscribing per layer), kept for /debug/requests."""
        deps, times = self.deps, list[float]()
        deps.registry.remember_arrivals(self.request_id, times)
        try:
            for layer in range(deps.compat.num_layers):
                await self.kv_in.load(self.request_id, layer, timeout)
                times.append(time.monotonic())
        except Exception:  # noqa: BLE001 - failures are handled by the session itself
            pass

    async def _admit(self, start: pb.Start) -> SessionInfo | None:
        """Steps 1-2: the session registered, or None when refused (the Refusal sent)."""
        deps = self.deps
        rid = start.request_id
        pooled_refusal = admission.pooled_refusal(start)
        refused = admission.refusal(start, deps.compat, max_model_len=deps.max_model_len,
                                    total_blocks=deps.engine.num_blocks, draining=deps.registry.draining,
                                    has_session=rid in deps.registry,
                                    pool_blocks=deps.pool.room()[1] if deps.pool is not None else 0,
                                    pooled_refusal=pooled_refusal)
        if refused is None:
            try:
                block_ids, cached = await self._reserve(start)
            except deps.out_of_blocks_error as exc:  # busy now; blocks free up as requests finish
                code = getattr(exc, "code", "out_of_blocks")  # "tbt_bound": no room within --tbt-slo-ms now
                refused = (code, getattr(exc, "reason", str(exc)))
                if code == "out_of_blocks" and deps.pool is not None and pooled_refusal is None:  # borrow
                    refused = await self._open_pooled(deps.pool, start, refused[1])
                    if refused is None:
                        return self.info
            except ValueError as exc:  # prompt too long, bad ids: nothing was reserved
                refused = ("bad_request", str(exc))
        if refused is not None:
            log.info("refused %s: %s", rid, refused[1])
            await self.refuse(*refused)
            return None
        self.reserved = True
        self.cached_blocks = cached // deps.compat.block_size
        self.info = info = SessionInfo(rid, "allocate", num_blocks=len(block_ids))
        deps.registry.add(info)
        to_receive = list(block_ids[self.cached_blocks: start.blocks_needed])
        timeout = min(start.timeout_s or deps.session_timeout_s, deps.session_timeout_s)
        pieces = deps.ranks.plan(start.compat) if deps.ranks is not None else None
        if pieces is not None:  # each prefill rank pushes its pieces to our ranks
            assert deps.ranks is not None
            self.kv_in = self.arrival = await deps.ranks.expect(rid, to_receive, timeout, pieces)
            self.expected = True
            await self.write(allocation=pb.Allocation(block_ids=to_receive, cached_blocks=self.cached_blocks,
                                                      rank_targets=self.arrival.targets))
            return info
        for_sender = deps.receiver.expect(rid, to_receive, timeout)
        self.expected = True
        await self.write(allocation=pb.Allocation(block_ids=list(for_sender),
                                                  cachestore_endpoint=deps.receiver.endpoint,
                                                  cached_blocks=self.cached_blocks, kv_token=for_sender.token))
        return info

    async def _reserve(self, start: pb.Start) -> tuple[list[int], int]:
        """The engine's reservation; if we are cancelled meanwhile (prefill gone), the engine still
        makes it: it is released as soon as it is made, never left behind."""
        deps, rid = self.deps, start.request_id
        task = asyncio.ensure_future(deps.engine.reserve(rid, list(start.prompt_token_ids), start.sampling.max_tokens,
                                                         start.reuse_prefix))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            def release_if_made(t: asyncio.Future) -> None:
                if not t.cancelled() and t.exception() is None:
                    release = asyncio.ensure_future(deps.engine.release(rid))
                    _BACKGROUND.add(release)
                    release.add_done_callback(_BACKGROUND.discard)
            task.add_done_callback(release_if_made)
            raise

    async def _stop_receiving(self) -> None:
        """ComputePrompt: no KV comes; drop the CacheStore entry before the engine writes the blocks."""
        self.kv_in.delete(self.request_id)
        self.expected = False
        await self.kv_in.released(self.request_id, 5.0)

    async def _decode(self, start: pb.Start, first_token: int | None) -> None:
        """Step 4: stream the engine's outputs; ``first_token`` None: compute the prompt here first."""
        deps = self.deps
        gate = self.deps.gates.decode  # test hook: held before joining the batch until the test opens the gate
        if gate:
            await wait_at_gate(gate, self.request_id)
        ids = list(start.prompt_token_ids)
        deps.engine.track(self.request_id, start)
        if first_token is None:
            produced, began = 0, time.monotonic()
            outputs = deps.engine.prefill_reserved(self.request_id, ids, start.sampling)
        else:
            produced, began = 1, None
            outputs = deps.engine.add_prefilled(self.request_id, ids, first_token, start.sampling)
        try:
            async for out in outputs:
                if out.error:
                    raise SessionEnded(f"decode engine failed: {out.error}")
                if began is not None:  # the prompt is computed: how fast (reported in our load reports)
                    deps.engine.computed_prompt(len(ids) - self.cached_blocks * deps.compat.block_size,
                                                time.monotonic() - began)
                    began = None
                if out.new_token_ids:
                    produced += len(out.new_token_ids)
                    lps = [logprob_to_proto(lp) for lp in out.logprobs or ()]
                    await self.write(tokens=pb.Tokens(token_ids=list(out.new_token_ids), logprobs=lps))
                if out.finished:
                    await self.write_finish(out.finish_reason or "stop", produced)
                    self.outcome = ("ok", out.finish_reason or "stop")
                    finish_gate = self.deps.gates.decode_finish  # test hook: the prefill's close comes first
                    if finish_gate:
                        await wait_at_gate(finish_gate, self.request_id)
                    return
        finally:
            await outputs.aclose()  # an unfinished stream aborts the request in the engine
        raise SessionEnded("the engine stopped the request without finishing it")

    async def _release(self) -> None:
        """Step 5. Synchronous parts first: this runs in ``finally`` of a possibly cancelled
        task, and a second cancellation must not skip any of it; the engine abort is shielded."""
        deps, rid = self.deps, self.request_id
        if not rid:  # no Start (or refused before anything was held)
            return
        was_receiving = self.expected
        if self.expected:
            self.kv_in.delete(rid)
            self.expected = False
        if self.arrival is not None:
            self.arrival.forget()
        if self.info is not None and deps.registry.remove(self.info):
            deps.metrics.request_done(*self.outcome)
        if self.pooled is not None:
            await self.pooled.close()
        if self.reserved:
            release = asyncio.ensure_future(self._free_blocks(rid, was_receiving))
            try:
                await asyncio.shield(release)
            except asyncio.CancelledError:
                pass  # the shielded release still completes on the loop

    async def _free_blocks(self, rid: str, was_receiving: bool) -> None:
        """Give the request's blocks back to the engine, but only once no KV frame can still
        land in them (a frame cut off by delete stops within one piece)."""
        deps = self.deps
        if was_receiving:
            try:
                await self.kv_in.released(rid, 5.0)
            except Exception as exc:  # noqa: BLE001 - still free them; log why it took so long
                log.warning("request %s: %s", rid, exc)
        await deps.engine.release(rid)
