"""The prefill end of the Session stream: one request's whole P/D conversation with a decode.

Request lifecycle on prefill (``SessionRunner.run``, once per request and decode tried):

1. **start** - open the bidirectional ``Session`` stream to the chosen decode and send
   ``Start`` (prompt tokens, sampling, blocks needed, compat, protocol version, timeout).
2. **allocation** - wait for ``Allocation`` (block ids + CacheStore endpoint) or
   ``Refusal``; a refusal, an unreachable decode or a broken stream raises ``Retryable``
   so the router can try the next decode: nothing has reached the client yet.
3. **prefill + push** - bind the request in the CacheStore sender to decode's blocks and
   run prefill layer by layer; the engine's per-layer callback hands each layer's blocks
   to ``sender.store`` (non-blocking), so the wire works while the next layer computes.
4. **first token** - wait until every layer was sent, free prefill's own KV blocks, send
   ``FirstToken`` on the stream and yield it to the client.
5. **relay** - yield decode's ``Tokens`` until ``Finish``. A decode ``Error``, a broken
   stream, or no message from decode for ``session_timeout_s`` (a frozen decode keeps its
   connection open: only this timer notices) raises ``DecodeFailed`` from here on (the
   client already has tokens; the router resumes elsewhere or the HTTP layer turns it into
   an error event).
6. **release** - always: if the request did not finish, cancel the stream (decode frees
   its side when it sees the cancellation); release prefill's blocks; delete the
   CacheStore entry. Cancelling ``run`` (client gone, request deadline) releases the same
   way, also while the engine is still computing the prompt.

Leases: every wait on the decode has a timer (``connect_timeout_s`` for the Allocation,
``session_timeout_s`` for the KV push, the FirstToken write and each next message), and
the Session call itself carries the request's deadline (plus ``DEADLINE_SLACK_S``) as its
gRPC deadline, so the decode frees its side by then even if this process is frozen.

``SessionRunner`` is built once per prefill process from exactly what it uses: a stub per
decode address, the engine (``prefill_only`` / ``release``), the CacheStore sender, the
registry of open sessions (request id -> decode address, for /health), an observer told
about allocations and finished pushes (picker accounting, metrics) and ``SessionConfig``.
"""

from __future__ import annotations

import asyncio
import os
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import grpc

from pdserve.engine import blocks_needed
from pdserve.cachestore.errors import CHECKSUM_MISMATCH, ChecksumError, TransferError
from pdserve.protos import session_pb2 as pb
from pdserve.protos.version import PROTOCOL_VERSION

if TYPE_CHECKING:
    from pdserve.cachestore import CacheStoreSender
    from pdserve.engine import AsyncLLMEngine
    from pdserve.protos import session_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# The Session's gRPC deadline is the request's deadline plus this: normally prefill ends the
# request at its deadline itself (a clear error to the client, a cancel to decode); the gRPC
# deadline is the decode's backstop when prefill cannot say so (frozen).
DEADLINE_SLACK_S = 1.0

# Test hook (never set it in production): seconds the prefill waits between the decode's
# Allocation and its forward pass, so a test can freeze it while the decode holds blocks.
HOLD_AFTER_ALLOCATION_S = float(os.environ.get("PDSERVE_TEST_HOLD_AFTER_ALLOCATION_S", "0") or 0)


class Retryable(Exception):
    """This decode cannot take the request (refused, unreachable, failed before any token)."""

    def __init__(self, reason: str, code: str = "decode_unreachable"):
        super().__init__(reason)
        self.reason, self.code = reason, code


class DecodeFailed(Exception):
    """The decode failed after tokens reached the client; ``code`` is the decode's Error code when it
    gave one (``kv_checksum_mismatch``: the KV arrived corrupted there), else "decode_failed"."""

    def __init__(self, reason: str, code: str = "decode_failed"):
        super().__init__(reason)
        self.code = code or "decode_failed"


class NoDecodeAvailable(Exception):
    """The request cannot be served now (no decode took it, no fallback, or prefill is full): 503."""


@dataclass(slots=True)
class Delta:
    """New tokens for the client; the last Delta of a request has ``finished`` set."""

    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None


@dataclass(slots=True)
class SessionTimings:
    """Monotonic timestamps of one P/D request (for metrics and the overlap test)."""

    start: float = field(default_factory=time.monotonic)
    allocated: float = 0.0
    prefill_done: float = 0.0
    kv_sent: float = 0.0
    layer_stored: list[float] = field(default_factory=list)
    layer_send_seconds: list[float] = field(default_factory=list)  # per layer: handed to the CacheStore -> delivered


def decode_reservation(n_prompt: int, max_tokens: int, block_size: int) -> int:
    """KV blocks a decode reserves for a request: prompt + max_tokens, never preempted."""
    return blocks_needed(n_prompt + max_tokens, block_size)


def sampling_to_proto(sp) -> pb.Sampling:
    """The engine's SamplingParams as the Session's Sampling message."""
    msg = pb.Sampling(
        max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k or 0,
        stop=list(sp.stop or []), stop_token_ids=list(sp.stop_token_ids or []), ignore_eos=bool(sp.ignore_eos),
    )
    if sp.seed is not None:
        msg.seed = sp.seed
    return msg


def first_token_finishes(token: int, sp, eos_token_ids) -> str | None:
    """Finish reason if prefill's sampled token already ends the request, else None."""
    if token in (sp.stop_token_ids or ()) or (not sp.ignore_eos and token in eos_token_ids):
        return "stop"
    if sp.max_tokens <= 1:
        return "length"
    return None


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """The fixed facts of this prefill that every Session uses."""

    compat: pb.Compat  # sent in Start; decode refuses a mismatch
    block_size: int
    eos_token_ids: tuple[int, ...] = ()
    session_timeout_s: float = 30.0  # KV push, each wait on decode's next message, and decode's wait for us (sent in Start)
    connect_timeout_s: float = 5.0  # Start -> Allocation
    layerwise_push: bool = True  # push each layer as it is written (False: all layers after the forward pass)
    out_of_blocks_error: type[Exception] = RuntimeError  # the engine's OutOfBlocksError


class SessionObserver(Protocol):
    """Told what a Session did (picker accounting, metrics); see transfer_accounting.py."""

    def allocated(self, address: str, blocks_reserved: int) -> None: ...

    def transferred(self, timings: SessionTimings, blocks: int) -> None: ...


class SessionRunner:
    """Runs the prefill end of Session streams, one ``run`` per request and decode tried."""

    def __init__(self, config: SessionConfig, *, stubs: Callable[[str], pb_grpc.DecodeStub], engine: AsyncLLMEngine,
                 sender: CacheStoreSender, registry: dict[str, str], observer: SessionObserver):
        self.config, self.stubs, self.engine, self.sender = config, stubs, engine, sender
        self.registry, self.observer = registry, observer
        self._releasing: set[asyncio.Task] = set()  # engine releases queued by cancelled runs

    async def run(self, address: str, request_id: str, prompt_ids: list[int], sp, timings: SessionTimings | None = None,
                  deadline: float | None = None, on_allocated: Callable[[], None] | None = None):
        """Async generator of Deltas for one request served by the decode at ``address``.

        ``deadline`` (``time.monotonic()`` seconds) is the request's end-to-end deadline:
        the Session call gets it (plus ``DEADLINE_SLACK_S``) as its gRPC deadline.
        ``on_allocated`` is called once the decode allocated (after the observer was told).
        Raises Retryable before the first Delta, DecodeFailed after it.
        """
        cfg = self.config
        timings = timings or SessionTimings()
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic()) + DEADLINE_SLACK_S
        call = self.stubs(address).Session(timeout=timeout)
        self.registry[request_id] = address
        finished = bound = prefilled = released = False
        try:
            # 1. start
            n_blocks = blocks_needed(len(prompt_ids), cfg.block_size)
            start = pb.Start(
                request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling_to_proto(sp),
                blocks_needed=n_blocks, compat=cfg.compat, protocol_version=PROTOCOL_VERSION,
                timeout_s=cfg.session_timeout_s,
            )
            # 2. allocation
            alloc = await self._allocation(call, address, start)
            timings.allocated = time.monotonic()
            # decode reserved prompt + max_tokens (not only the prompt blocks it receives)
            self.observer.allocated(address, decode_reservation(len(prompt_ids), sp.max_tokens, cfg.block_size))
            if on_allocated is not None:
                on_allocated()
            if HOLD_AFTER_ALLOCATION_S:  # test hook: a window in which the decode holds a reservation
                await asyncio.sleep(HOLD_AFTER_ALLOCATION_S)
            # 3. prefill + push, layer by layer
            try:
                self.sender.bind(request_id, alloc.cachestore_endpoint, list(alloc.block_ids))
            except (ValueError, TransferError) as exc:  # CompatError, transport mismatch, receiver unreachable
                raise Retryable(f"{address}: CacheStore cannot bind the request: {exc}", "incompatible") from None
            bound = True

            held: list[tuple[int, list[int]]] = []  # layers written but not pushed yet (layerwise_push off)

            def on_layer(layer: int, block_ids) -> None:  # runs on the engine's thread
                timings.layer_stored.append(time.monotonic())
                if cfg.layerwise_push:
                    self.sender.store(request_id, layer, list(block_ids)[:n_blocks])
                else:
                    held.append((layer, list(block_ids)[:n_blocks]))

            prefilled = True
            try:
                first = await self.engine.prefill_only(request_id, prompt_ids, sp, on_layer=on_layer)
            except cfg.out_of_blocks_error as exc:
                prefilled = False  # prefill_only frees what it took when it fails
                raise Retryable(f"prefill has no free KV blocks for this prompt now: {exc}", "prefill_busy") from None
            except asyncio.CancelledError:
                # only our wait ends: the engine thread finishes the prompt and then holds its
                # blocks. Queue their release behind it without making the caller (a client
                # past its deadline) wait for the computation.
                prefilled = False
                self._release_later(request_id)
                raise
            except BaseException:
                prefilled = False
                raise
            timings.prefill_done = time.monotonic()
            for layer, block_ids in held:  # overlap off: the whole KV goes now
                self.sender.store(request_id, layer, block_ids)
            # 4. first token
            try:
                await self.sender.wait_sent(request_id, cfg.session_timeout_s)
            except Exception as exc:  # TransferError, timeout: the decode never got the KV (ChecksumError: corrupted)
                code = CHECKSUM_MISMATCH if isinstance(exc, ChecksumError) else "kv_transfer_failed"
                raise Retryable(f"{address}: KV transfer failed: {exc}", code) from None
            timings.kv_sent = time.monotonic()
            timings.layer_send_seconds = [done - stored for stored, done in self.sender.layer_times(request_id).values()]
            await self.engine.release(request_id)
            released = True
            self.observer.transferred(timings, n_blocks)
            reason = first_token_finishes(first, sp, cfg.eos_token_ids)
            # a stop token ends the request and is not part of the output (as in the engine)
            first_out = [] if reason == "stop" else [first]
            try:
                await asyncio.wait_for(call.write(pb.PrefillMessage(first_token=pb.FirstToken(
                    token_id=first, finished=reason is not None, finish_reason=reason or ""))), cfg.session_timeout_s)
            except asyncio.TimeoutError:
                raise Retryable(f"{address}: did not take the first token within {cfg.session_timeout_s:g}s") from None
            except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
                raise Retryable(f"{address}: {_rpc_reason(exc)}") from None
            if reason is not None:
                finished = True
                yield Delta(first_out, True, reason)
                return
            yield Delta([first])
            # 5. relay
            while True:
                delta = await self._next_delta(call, address, cfg.session_timeout_s)
                finished = delta.finished
                yield delta
                if finished:
                    return
        finally:
            # 6. release (the synchronous steps run even if an await below is interrupted)
            try:
                if not finished:
                    call.cancel()
                else:
                    # half-close politely, but never wait on it unbounded
                    try:
                        await asyncio.wait_for(call.done_writing(), self.config.connect_timeout_s)
                    except Exception:  # noqa: BLE001 - already closed by decode, or no answer: cancel
                        call.cancel()
                if prefilled and not released:
                    await self.engine.release(request_id)
            finally:
                if bound:
                    self.sender.delete(request_id)
                self.registry.pop(request_id, None)

    def _release_later(self, request_id: str) -> None:
        task = asyncio.ensure_future(self.engine.release(request_id))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _allocation(self, call, address: str, start: pb.Start) -> pb.Allocation:
        """Steps 1-2: send Start, wait for the Allocation; anything else raises Retryable."""
        cfg = self.config
        try:
            await asyncio.wait_for(call.write(pb.PrefillMessage(start=start)), cfg.connect_timeout_s)
            reply = await asyncio.wait_for(call.read(), cfg.connect_timeout_s)
        except asyncio.TimeoutError:
            raise Retryable(f"{address}: no answer within {cfg.connect_timeout_s:.1f}s") from None
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
            raise Retryable(f"{address}: {_rpc_reason(exc)}") from None
        if reply is grpc.aio.EOF:
            raise Retryable(f"{address}: closed the session before answering")
        kind = reply.WhichOneof("kind")
        if kind == "refusal":
            raise Retryable(f"{address} refused: {reply.refusal.reason}", reply.refusal.code or "refused")
        if kind != "allocation":
            reason = reply.error.reason if kind == "error" else f"unexpected {kind} message"
            raise Retryable(f"{address}: {reason}")
        if len(reply.allocation.block_ids) != start.blocks_needed:
            raise Retryable(f"{address}: allocated {len(reply.allocation.block_ids)} blocks, "
                            f"{start.blocks_needed} needed")
        return reply.allocation

    @staticmethod
    async def _next_delta(call, address: str, idle_s: float) -> Delta:
        """Step 5: decode's next Tokens (or Finish: a finished Delta) within ``idle_s``; anything
        else (an error, a broken stream, silence: a frozen decode) raises DecodeFailed."""
        try:
            msg = await asyncio.wait_for(call.read(), idle_s)
        except asyncio.TimeoutError:
            raise DecodeFailed(f"decode {address} sent nothing for {idle_s:g}s (--session-timeout)") from None
        except grpc.aio.AioRpcError as exc:
            raise DecodeFailed(f"decode {address} failed mid-generation: {_rpc_reason(exc)}") from None
        if msg is grpc.aio.EOF:
            raise DecodeFailed(f"decode {address} closed the session before finishing")
        kind = msg.WhichOneof("kind")
        if kind == "tokens":
            return Delta(list(msg.tokens.token_ids))
        if kind == "finish":
            return Delta([], True, msg.finish.finish_reason or "stop")
        if kind == "error":
            raise DecodeFailed(f"decode {address} failed mid-generation: {msg.error.reason}", msg.error.code)
        raise DecodeFailed(f"decode {address} sent an unexpected {kind} message")


def _rpc_reason(exc: Exception) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)
