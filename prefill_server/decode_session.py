"""The prefill end of the Session stream: one request's whole P/D conversation with a decode.

Request lifecycle on prefill (``SessionRunner.run``, once per request and decode tried):

0. **line** - the prompt waits in our engine's Scheduler as a remote prefill waiting for its grant
   (``engine_line.py``: a ``LinePlace``, usually the conductor's, kept across its attempts): it
   holds nothing on any decode until the Scheduler wants it, so a request queued behind our
   engine never sits on a decode's blocks, where the decode's wait for its KV would time out.
   With ``--disaggregation never`` (and no prompt logprobs) our engine never computes it: no line.
1. **start** - open the bidirectional ``Session`` stream to the chosen decode and send
   ``Start`` (prompt tokens, sampling, blocks needed, compat, protocol version, timeout,
   ``reuse_prefix``: may the decode serve the prompt's leading blocks from its prefix cache).
2. **allocation** - wait for ``Allocation`` (``cached_blocks`` the decode already holds and
   has pinned for this session, block ids for the other prompt blocks, CacheStore endpoint)
   or ``Refusal``; a refusal, an unreachable decode or a broken stream raises ``Retryable``
   so the node can try the next decode: nothing has reached the client yet.
3. **decide** - the Disaggregator (cost model, cost_model.py) chooses where the prompt is
   computed: remote (steps 4r-5r, today's P/D path) or local (4l). An Allocation that says
   ``pooled`` (the decode's KV pool holds part of the request on its lenders) goes 4r when it
   lists ``pool_targets`` (each lender's blocks: step 4r pushes every part of the prompt's KV
   straight to where it lives, one CacheStore binding per part) and 4l when it lists no
   blocks (the decode computes the prompt and places the overflow on its lenders itself).
   A request with ``prompt_logprobs`` (echo with logprobs) is always remote: our engine
   computes its whole prompt (no prefix hit here; the decode may still hold leading blocks,
   which then do not move) and its prompt logprobs go with the first Delta; a pooled
   Allocation without blocks cannot give them (Retryable: the next decode).
4r. **prefill + push** - bind the request in the CacheStore sender to decode's blocks and
   grant the prompt's place in our engine's line (step 0); the engine's per-layer callback hands each
   chunk's newly written blocks after the decode's cached ones to ``sender.store``
   (non-blocking), so the wire works while the next layer (and the next chunk) computes; only
   the missing blocks move, each block of each layer once. With ``rank_targets`` in the Allocation
   (the per-rank push, ``rank_senders.py``) there is one destination per piece (heads of one decode rank
   from one of our ranks), each bound in the sender of our rank holding its heads (or of the slice of them it
   takes, packed contiguous after each layer), and each layer goes to every one of them.
5r. **first token** - wait until every layer was sent, free prefill's own KV blocks, send
   ``FirstToken`` on the stream and yield it to the client (with the prompt tokens our prefix
   cache held: the response's ``usage.prompt_tokens_details.cached_tokens``).
4l. **compute on decode** - send ``ComputePrompt``; the decode computes the prompt after its
   cached blocks and streams every token; its first Tokens (or Finish) is the first Delta (its
   ``cached_tokens``: the decode's cached blocks).
   Before it the failures are still ``Retryable``; no KV moves, our engine is not used (the prompt
   leaves its line, never computed).
6. **relay** - yield decode's ``Tokens`` until ``Finish``. A decode ``Error``, a broken
   stream (also a call cancelled by its channel closing: gRPC raises CancelledError there,
   told apart from our own cancellation), or no message from decode for
   ``session_timeout_s`` (a frozen decode keeps its connection open: only this timer
   notices) raises ``DecodeFailed`` from here on (the client already has tokens; the node
   resumes elsewhere or the HTTP layer turns it into an error event).
7. **release** - always: if the request did not finish, cancel the stream (decode frees
   its side, cached blocks unpinned, when it sees the cancellation); release prefill's
   blocks; delete the CacheStore entry. Cancelling ``run`` (client gone, request deadline)
   releases the same way, also while the prompt waits in our engine's line or is being computed.

Leases: every wait on the decode has a timer (``connect_timeout_s`` for the Allocation,
``session_timeout_s`` for the KV push, the FirstToken / ComputePrompt write and each next
message), and the Session call itself carries the request's deadline (plus
``DEADLINE_SLACK_S``) as its gRPC deadline, so the decode frees its side by then even if this
process is frozen.

``SessionRunner`` is built once per prefill process (``wiring.build_node``) from exactly what it
uses: a stub per decode address, the engine, the CacheStore sender, the registry of open sessions
(request id -> decode address, for /health), the observer (transfer_accounting.py), the
Disaggregator and ``SessionConfig``. Errors, Deltas and helpers are in session_protocol.py (re-exported here); the
messages on the wire, with their timers, in session_wire.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from pdserve.cachestore.errors import CHECKSUM_MISMATCH, ChecksumError, TransferError
from pdserve.engine import blocks_needed
from pdserve.protos import session_pb2 as pb
from pdserve.protos.logprobs import logprob_to_proto
from pdserve.protos.version import PROTOCOL_VERSION
from pdserve.test_hooks import NO_GATES, TestGates, hold_thread_at_gate, wait_at_gate

from . import session_wire as wire
from .cost_model import LOCAL, REMOTE, Decision, link_busy_seconds
from .engine_line import EngineLine, LinePlace
from .rank_senders import Part, RankSenders
from .session_protocol import (DecodeFailed, Delta, NoDecodeAvailable, Retryable, SessionConfig, SessionObserver,
                               SessionTimings, decode_reservation, first_token_finishes, sampling_to_proto)

if TYPE_CHECKING:
    from pdserve.cachestore import CacheStoreSender
    from pdserve.engine import SamplingParams
    from pdserve.engine.server_engine import ServerEngine
    from pdserve.protos import session_pb2_grpc as pb_grpc
    from pdserve.slo import SloClass

    from .disaggregator import Disaggregator

log = logging.getLogger(__name__)

__all__ = ["DEADLINE_SLACK_S", "DecodeFailed", "Delta", "NoDecodeAvailable", "Retryable", "SessionConfig",
           "SessionObserver", "SessionRunner", "SessionTimings", "decode_reservation", "first_token_finishes",
           "sampling_to_proto"]

# The Session's gRPC deadline is the request's deadline plus this: normally prefill ends the
# request at its deadline itself (a clear error to the client, a cancel to decode); the gRPC
# deadline is the decode's backstop when prefill cannot say so (frozen).
DEADLINE_SLACK_S = 1.0

# Test hook (pdserve/test_hooks.py, TestGates.prefill_after_allocation; tests/harness/gates.py drives it):
# between the decode's Allocation and the forward pass a request waits at the gate, so a test holds requests while
# the decode holds their blocks for exactly as long as it needs. Cancelling the request (its client
# gone, its deadline: the Frontend cancels it) ends the wait. Off: an empty string, read once at start.


@dataclass(slots=True)
class _Held:
    """What one run holds on this side, for step 7."""

    bound: list[Part] = field(default_factory=list)  # parts a CacheStore sender knows (pooled: lenders'; per rank)
    place: LinePlace | None = None  # the prompt's place in our engine's line this run owns (its own, or granted)
    released: bool = False  # our engine computed the prompt and released its blocks
    finished: bool = False  # the decode finished the request


class SessionRunner:
    """Runs the prefill end of Session streams, one ``run`` per request and decode tried."""

    def __init__(self, config: SessionConfig, *, stubs: Callable[[str], pb_grpc.DecodeStub], engine: ServerEngine,
                 sender: CacheStoreSender, registry: dict[str, str], observer: SessionObserver,
                 disaggregator: Disaggregator, gates: TestGates = NO_GATES, ranks: RankSenders | None = None):
        self.config, self.stubs, self.engine, self.sender = config, stubs, engine, sender
        self.ranks = ranks  # the per-rank push's senders (rank_senders.py); None: not offered (Compat.kv_push 0)
        self.gates = gates  # test hooks (pdserve/test_hooks.py), read once by the wiring
        self.registry, self.observer, self.disaggregator = registry, observer, disaggregator
        self._releasing: set[asyncio.Task] = set()  # engine releases queued by cancelled runs
        self.line = EngineLine(engine, config.line_tokens, config.out_of_blocks_error, self._release_later)

    def needs_line(self, sp: SamplingParams) -> bool:
        """Whether our engine may compute the prompt (step 0 then waits in its line): not with ``--disaggregation
        never``, unless the request wants its prompt's logprobs."""
        return self.disaggregator.mode != "never" or sp.prompt_logprobs is not None

    async def run(self, address: str, request_id: str, prompt_ids: list[int], sp: SamplingParams,
                  timings: SessionTimings | None = None, deadline: float | None = None,
                  on_allocated: Callable[[], None] | None = None, slo_class: SloClass | None = None,
                  place: LinePlace | None = None):
        """Async generator of Deltas for one request served by the decode at ``address``.

        ``place``: the prompt's place in our engine's line, already wanted (the conductor's, kept across its
        attempts: a refusal leaves it in line for the next one; this run owns it once it grants it). None: the
        run takes its own place when our engine may compute the prompt.

        ``deadline`` (``time.monotonic()`` seconds) is the request's end-to-end deadline:
        the Session call gets it (plus ``DEADLINE_SLACK_S``) as its gRPC deadline.
        ``on_allocated`` is called once the decode allocated (after the observer was told).
        ``slo_class``: the request's SLO class; the decode learns its TBT target and whether it
        may evict the request's KV (``decode_server/lso.py``).
        Raises Retryable before the first Delta, DecodeFailed after it.
        """
        cfg = self.config
        timings = timings or SessionTimings()
        held = _Held()
        call = None
        try:
            if place is None and self.needs_line(sp):  # 0. line
                place = held.place = self.line.enter(request_id, prompt_ids, sp)
            if place is not None:
                await place.wanted()
            call = self._open(address, request_id, deadline)  # 1. start, 2. allocation
            n_blocks = blocks_needed(len(prompt_ids), cfg.block_size)
            start = self._start(request_id, prompt_ids, sp, n_blocks, slo_class)
            alloc = await wire.allocation(call, address, start, self.config.connect_timeout_s)
            timings.allocated, timings.cached_blocks = time.monotonic(), alloc.cached_blocks
            decision, prefill_cached = self._decide(address, request_id, prompt_ids, sp, alloc)  # 3. decide
            timings.where = decision.where
            # decode reserved prompt + max_tokens (not only the prompt blocks it receives)
            self.observer.allocated(address, decode_reservation(len(prompt_ids), sp.max_tokens, cfg.block_size))
            if on_allocated is not None:
                on_allocated()
            gate = self.gates.prefill_after_allocation  # test hook: the decode holds the reservation (request has left
            if gate:  # the admission queue: it is admitted) until the test opens the gate
                await wait_at_gate(gate, request_id)
            if decision.where == LOCAL:  # 4l
                if place is not None:
                    place.leave()  # our engine does not compute this prompt
                first = await self._compute_on_decode(call, address, decision.reason, alloc.cached_blocks, n_blocks)
            else:  # 4r, 5r
                if place is None:  # no line was needed before the decode's answer (a pooled allocation): now
                    place = held.place = self.line.enter(request_id, prompt_ids, sp)
                    await place.wanted()
                first = await self._push(call, address, request_id, sp, alloc, prefill_cached, timings, held, place)
            held.finished = first.finished
            yield first
            # 6. relay
            while not held.finished:
                delta = await wire.next_delta(call, address, cfg.session_timeout_s)
                held.finished = delta.finished
                yield delta
        finally:
            await self._release(call, request_id, held)  # 7. release

    def _open(self, address: str, request_id: str, deadline: float | None):
        """The Session call to ``address`` (for step 1), registered as open."""
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic()) + DEADLINE_SLACK_S
        call = self.stubs(address).Session(timeout=timeout)
        self.registry[request_id] = address
        return call

    def _start(self, request_id: str, prompt_ids: list[int], sp: SamplingParams, n_blocks: int,
               slo_class: SloClass | None) -> pb.Start:
        """Step 1's message."""
        cfg = self.config
        return pb.Start(
            request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling_to_proto(sp),
            blocks_needed=n_blocks, compat=cfg.compat, protocol_version=PROTOCOL_VERSION,
            timeout_s=cfg.session_timeout_s, reuse_prefix=cfg.reuse_prefix,
            tbt_target_ms=(slo_class.tbt_ms or 0) if slo_class else 0,
            evictable=slo_class.evictable if slo_class else False,
        )

    def _decide(self, address: str, request_id: str, prompt_ids: list[int], sp: SamplingParams,
                alloc: pb.Allocation) -> tuple[Decision, int]:
        """Step 3 (before this session counts in the decode's load: it stalls the others, not itself): where
        the prompt is computed, and how many of its leading blocks our prefix cache holds."""
        # prompt logprobs need every prompt position's logits: only our engine gives them (whole prompt, no reuse)
        needs_logits = sp.prompt_logprobs is not None
        prefill_cached = 0 if needs_logits else self.disaggregator.prefill_cached_blocks(prompt_ids)
        if alloc.pooled and not alloc.pool_targets:  # no blocks to push into: the decode computes it
            if needs_logits:
                raise Retryable(f"{address}: its KV pool would compute the prompt on the decode; prompt logprobs "
                                f"(echo with logprobs) need it computed here")
            return Decision(LOCAL, "pooled"), prefill_cached
        if alloc.pooled:  # our KV goes to the decode and its lenders, each part where it lives
            return Decision(REMOTE, "pooled"), prefill_cached
        decision = self.disaggregator.decide(address, request_id, prompt_ids, alloc.cached_blocks, prefill_cached,
                                             prompt_logprobs=needs_logits)
        return decision, prefill_cached

    async def _release(self, call, request_id: str, held: _Held) -> None:
        """Step 7 (the synchronous steps run even if an await below is interrupted)."""
        place = held.place
        if place is not None and not place.task.done():
            place.leave()  # still in our engine's line, or being computed: out of it
        try:
            if call is None:
                pass
            elif not held.finished:
                call.cancel()
            else:
                # half-close politely, but never wait on it unbounded
                try:
                    async with asyncio.timeout(self.config.connect_timeout_s):
                        await call.done_writing()
                except Exception:  # noqa: BLE001 - already closed by decode, or no answer: cancel
                    call.cancel()
                except asyncio.CancelledError:
                    if not wire.closed_under_us(call):  # the request finished; its channel closed after
                        raise
            if place is not None and place.computed and not held.released:
                await self.engine.release(place.engine_id)
        finally:
            for part in held.bound:
                part.sender.delete(part.request_id)
            self.registry.pop(request_id, None)

    async def _push(self, call, address: str, request_id: str, sp: SamplingParams, alloc: pb.Allocation,
                    prefill_cached: int, timings: SessionTimings, held: _Held, place: LinePlace) -> Delta:
        """Steps 4r-5r: our forward pass pushes the blocks the decode lacks; then the FirstToken."""
        cfg = self.config
        first_block, n_blocks = alloc.cached_blocks, blocks_needed(place.num_tokens, cfg.block_size)
        parts = await self._bind(address, request_id, alloc, held)
        layers: list[tuple[int, list[int], int]] = []  # layers written but not pushed yet (layerwise_push off)

        def store(layer: int, block_ids: list[int], first: int) -> None:
            """Prompt blocks [first, first + len(block_ids)) of a layer (one chunk's), each to its part."""
            for part in parts:
                lo, hi = max(part.start, first), min(part.end, first + len(block_ids))
                if lo < hi:
                    src = block_ids[lo - first:hi - first]
                    if part.pack is not None:  # a slice of a rank's heads: made contiguous first (tp/pieces.py)
                        part.pack(layer, src)
                    part.sender.store(part.request_id, layer, src, lo - part.start)

        layer_gate = self.gates.layer  # test hook: hold the engine after the last chunk's layer 0 (overlap shown)

        def on_layer(layer: int, block_ids, first: int) -> None:  # runs on the engine's thread
            timings.layer_stored.append(time.monotonic())
            if cfg.layerwise_push:
                store(layer, list(block_ids), first)
            else:
                layers.append((layer, list(block_ids), first))
            if layer_gate and layer == 0 and first + len(block_ids) >= n_blocks:  # the prompt's last chunk
                hold_thread_at_gate(layer_gate, request_id)

        held.place = place  # ours from its grant on (a failure before it leaves a borrowed place in line)
        before = self.engine.prefill_counters()
        with self.disaggregator.computing(place.num_tokens - prefill_cached * cfg.block_size):
            # per rank: every rank's pool is read by its own sender (the engine's ranks only sync after each layer)
            await place.grant(on_layer, kv_direct=bool(alloc.rank_targets))
            first = await place.first_token()
        timings.prefill_done = time.monotonic()
        engine_id = place.engine_id
        cached_tokens = self.engine.prefill_cached_tokens(engine_id)  # read before the release below
        first_lp = await self.engine.prefill_logprob(engine_id) if sp.logprobs is not None else None
        prompt_lps = await self.engine.prefill_prompt_logprobs(engine_id) if sp.prompt_logprobs is not None else None
        after = self.engine.prefill_counters()
        self.observer.prefilled(after[0] - before[0], after[1] - before[1])
        for layer, block_ids, first in layers:  # overlap off: the whole KV goes now
            store(layer, block_ids, first)
        await self._wait_sent(address, request_id, parts, timings)
        # the KV has left: free our copy without waiting for it, since the engine thread is usually
        # computing the next prompt by now and the release would queue behind that prompt, holding
        # this request's first token back by one whole prefill
        self._release_later(engine_id)
        held.released = True
        self.observer.transferred(timings, n_blocks - first_block)
        delta = await self._first_token(call, address, first, first_lp, prompt_lps, sp)
        delta.cached_tokens = cached_tokens
        return delta

    async def _bind(self, address: str, request_id: str, alloc: pb.Allocation, held: _Held) -> list[Part]:
        """Step 4r's destinations, each bound in its CacheStore sender (``Part``): the decode's blocks; a pooled
        request's lenders take the prompt blocks after them; with rank targets, each decode rank's heads of the
        decode's blocks, from the rank of ours holding them (``rank_senders.py``)."""
        first_block, n = alloc.cached_blocks, len(alloc.block_ids)
        try:
            if alloc.rank_targets:
                if self.ranks is None:
                    raise ValueError("the decode offered the per-rank push, which this prefill did not ask for")
                parts = await self.ranks.parts(alloc)
                tokens = [t.kv_token for t in alloc.rank_targets]
            else:
                parts = [Part(request_id, alloc.cachestore_endpoint, list(alloc.block_ids), first_block,
                              first_block + n, self.sender)]
                parts += [Part(t.request_id, t.cachestore_endpoint, list(t.block_ids), t.first_block,
                               t.first_block + len(t.block_ids), self.sender) for t in alloc.pool_targets]
                tokens = [alloc.kv_token] + [t.kv_token for t in alloc.pool_targets]
            for part, token in zip(parts, tokens):
                part.sender.bind(part.request_id, part.endpoint, part.dst, token)
                held.bound.append(part)
        except (ValueError, TransferError) as exc:  # CompatError, transport mismatch, receiver unreachable
            raise Retryable(f"{address}: CacheStore cannot bind the request: {exc}", "incompatible") from None
        return parts

    async def _wait_sent(self, address: str, request_id: str, parts: list[Part], timings: SessionTimings) -> None:
        """Step 5r's wait until every layer was sent (Retryable when the KV did not arrive); its timings."""
        try:
            for part in parts:
                await part.sender.wait_sent(part.request_id, self.config.session_timeout_s)
        except Exception as exc:  # TransferError, timeout: the decode never got the KV (ChecksumError: corrupted)
            code = CHECKSUM_MISMATCH if isinstance(exc, ChecksumError) else "kv_transfer_failed"
            raise Retryable(f"{address}: KV transfer failed: {exc}", code) from None
        timings.kv_sent = time.monotonic()
        if self.ranks is not None:
            if parts[0].per_rank:  # rank targets: every rank's shard delivered
                self.ranks.sent(parts)
            else:
                self.ranks.whole_heads += 1
        sent = sorted(parts[0].sender.layer_times(parts[0].request_id).items())
        timings.layer_send_seconds = [done - stored for _, (stored, done) in sent]
        timings.link_busy_s = link_busy_seconds([times for _, times in sent])

    async def _first_token(self, call, address: str, first: int, first_lp, prompt_lps, sp: SamplingParams) -> Delta:
        """Step 5r's FirstToken on the stream, and the first Delta."""
        reason = first_token_finishes(first, sp, self.config.eos_token_ids)
        message = pb.FirstToken(token_id=first, finished=reason is not None, finish_reason=reason or "")
        if first_lp is not None:
            message.logprob.CopyFrom(logprob_to_proto(first_lp))
        await wire.send(call, address, self.config.session_timeout_s, first_token=message)
        # a stop token ends the request and is not part of the output (as in the engine)
        if reason == "stop":
            return Delta([], True, reason, prompt_logprobs=prompt_lps)
        return Delta([first], reason is not None, reason, [first_lp] if first_lp is not None else None, prompt_lps)

    async def _compute_on_decode(self, call, address: str, reason: str, cached_blocks: int, n_blocks: int) -> Delta:
        """Step 4l: the decode computes the prompt; its first message is the first Delta."""
        await wire.send(call, address, self.config.session_timeout_s, compute_prompt=pb.ComputePrompt(reason=reason))
        self.observer.computed_on_decode(cached_blocks, n_blocks - cached_blocks)
        try:
            first = await wire.next_delta(call, address, self.config.session_timeout_s)
        except DecodeFailed as exc:  # nothing reached the client yet: another decode may take it
            raise Retryable(str(exc), exc.code) from None
        first.cached_tokens = cached_blocks * self.config.block_size  # the decode computed the prompt after them
        return first

    def _release_later(self, request_id: str) -> None:
        task = asyncio.ensure_future(self.engine.release(request_id))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

