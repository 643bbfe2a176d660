"""The Session's messages as the prefill sends and reads them (decode_session.py's steps 1-2, 4r/4l and 6).

Each wait has its timer and each failure its kind: before the client has anything,
``Retryable`` (the node tries the next decode); from the first token on, ``DecodeFailed``. A
call cancelled by its channel closing (gRPC raises CancelledError from its read/write) is told
apart from our own cancellation (``closed_under_us``) and carries the code ``CHANNEL_CLOSED``.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from pdserve.protos import session_pb2 as pb

from .session_protocol import DecodeFailed, Delta, Retryable, logprob_from_proto, rpc_reason


CHANNEL_CLOSED = "decode_channel_closed"  # Retryable/DecodeFailed code: the call was cancelled under us


def closed_under_us(call) -> bool:
    """True for an ``asyncio.CancelledError`` out of ``call`` that is not our task's cancellation.

    gRPC's asyncio API raises CancelledError from a call's read/write once the call is
    cancelled, also when nobody cancelled our task: when its channel closes under it (the
    load poller closes a decode's channel once the decode left discovery and the grace is
    over, or the server stops). That is the decode's session ending, not the client's
    request: it must become Retryable/DecodeFailed so the node tries or resumes elsewhere.
    """
    task = asyncio.current_task()
    return call.cancelled() and task is not None and task.cancelling() == 0


@contextlib.asynccontextmanager
async def _retryable(call, address: str, silent: str):
    """Failures of a write/read before the client has anything, as Retryable: ``silent`` when a
    wait timed out, the RPC's reason, or the channel closed under us (our own cancellation passes)."""
    try:
        yield
    except asyncio.TimeoutError:
        raise Retryable(f"{address}: {silent}") from None
    except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
        raise Retryable(f"{address}: {rpc_reason(exc)}") from None
    except asyncio.CancelledError:
        if closed_under_us(call):
            raise Retryable(f"{address}: the session's channel was closed", CHANNEL_CLOSED) from None
        raise


async def send(call, address: str, limit: float, **kind) -> None:
    """Write one PrefillMessage (``kind``: its one field) within ``limit`` seconds; else Retryable."""
    async with _retryable(call, address, f"did not take our {next(iter(kind))} within {limit:g}s"):
        async with asyncio.timeout(limit):
            await call.write(pb.PrefillMessage(**kind))


async def allocation(call, address: str, start: pb.Start, connect_timeout_s: float) -> pb.Allocation:
    """Steps 1-2: send Start, wait for the Allocation (each within ``connect_timeout_s``); anything else raises Retryable."""  # noqa: E501
    async with _retryable(call, address, f"no answer within {connect_timeout_s:.1f}s"):
        async with asyncio.timeout(connect_timeout_s):
            await call.write(pb.PrefillMessage(start=start))
        async with asyncio.timeout(connect_timeout_s):
            reply = await call.read()
    if reply is grpc.aio.EOF:
        raise Retryable(f"{address}: closed the session before answering")
    kind = reply.WhichOneof("kind")
    if kind == "refusal":
        raise Retryable(f"{address} refused: {reply.refusal.reason}", reply.refusal.code or "refused")
    if kind != "allocation":
        reason = reply.error.reason if kind == "error" else f"unexpected {kind} message"
        raise Retryable(f"{address}: {reason}")
    alloc = reply.allocation
    cached = alloc.cached_blocks
    if not 0 <= cached < start.blocks_needed or (cached and not start.reuse_prefix):
        raise Retryable(f"{address}: allocated with {cached} cached blocks for a prompt of {start.blocks_needed}"
                        f"{'' if start.reuse_prefix else ' (no reuse asked)'}")
    if alloc.pooled and (cached or bool(alloc.block_ids) != bool(alloc.pool_targets)
                         or pooled_blocks(alloc) not in (0, start.blocks_needed)):
        raise Retryable(f"{address}: a pooled allocation must list every prompt block (the decode's and its "
                        f"lenders') or none, with no cached blocks; got {pooled_blocks(alloc)} of "
                        f"{start.blocks_needed}, {cached} cached")
    if not alloc.pooled and len(alloc.block_ids) != start.blocks_needed - cached:
        raise Retryable(f"{address}: allocated {len(alloc.block_ids)} blocks, "
                        f"{start.blocks_needed - cached} needed ({cached} cached)")
    return alloc


async def next_delta(call, address: str, idle_s: float) -> Delta:
    """Decode's next Tokens (or Finish: a finished Delta) within ``idle_s``; anything else
    (an error, a broken stream, silence: a frozen decode) raises DecodeFailed."""
    try:
        async with asyncio.timeout(idle_s):
            msg = await call.read()
    except asyncio.TimeoutError:
        raise DecodeFailed(f"decode {address} sent nothing for {idle_s:g}s (--session-timeout)") from None
    except grpc.aio.AioRpcError as exc:
        raise DecodeFailed(f"decode {address} failed mid-generation: {rpc_reason(exc)}") from None
    except asyncio.CancelledError:
        if closed_under_us(call):
            raise DecodeFailed(f"decode {address}: the session's channel was closed mid-generation "
                               "(the decode left discovery and its grace ended, or this server stops)",
                               CHANNEL_CLOSED) from None
        raise
    if msg is grpc.aio.EOF:
        raise DecodeFailed(f"decode {address} closed the session before finishing")
    kind = msg.WhichOneof("kind")
    if kind == "tokens":
        lps = [logprob_from_proto(lp) for lp in msg.tokens.logprobs]
        return Delta(list(msg.tokens.token_ids), logprobs=lps or None)
    if kind == "finish":
        return Delta([], True, msg.finish.finish_reason or "stop")
    if kind == "error":
        raise DecodeFailed(f"decode {address} failed mid-generation: {msg.error.reason}", msg.error.code)
    raise DecodeFailed(f"decode {address} sent an unexpected {kind} message")


def pooled_blocks(alloc: pb.Allocation) -> int:
    """Prompt blocks a pooled Allocation lists: the decode's own and every lender's."""
    return len(alloc.block_ids) + sum(len(t.block_ids) for t in alloc.pool_targets)
