"""SessionStream: the decode end of one Session stream as a stream (no engine, no KV): what it
writes, what it reads, and how every wait on prefill ends.

Contract (``DecodeSession`` builds on it; its lifecycle is in session.py):

- ``write(**kind)`` sends one DecodeMessage; a prefill that does not take it within
  ``session_timeout_s`` (it stopped reading: a frozen prefill, gRPC flow control full)
  raises ``SessionEnded`` (not notified: the stream is stuck anyway).
- ``refuse(code, reason)`` counts and sends a Refusal.
- ``read_rest()`` (a task, after Start) resolves ``answer`` with prefill's decision, the
  ``FirstToken`` (its KV is on the way) or ``ComputePrompt`` (compute the prompt here); a
  Cancel, Error, end of stream, broken stream or any other message sets ``peer_gone`` with
  ``peer_reason``.
- ``until_peer_gone_or(aw, timeout, what)`` awaits ``aw`` unless prefill goes away
  (``SessionEnded``, not notified) or ``timeout`` passes (``SessionEnded`` naming ``what``);
  ``aw`` is cancelled and allowed to clean up in both cases.
- ``try_write_error(reason, code)`` tells prefill why the session ends, if it still can.
"""

from __future__ import annotations

import asyncio

import grpc

from pdserve.protos import session_pb2 as pb

from .session_metrics import SessionMetrics


class SessionEnded(Exception):
    """The session must end now; ``reason`` says why (sent to prefill as Error when possible)."""

    def __init__(self, reason: str, notify: bool = True):
        super().__init__(reason)
        self.reason, self.notify = reason, notify


class SessionStream:
    def __init__(self, context: grpc.aio.ServicerContext, metrics: SessionMetrics, session_timeout_s: float):
        self.context, self.metrics, self.session_timeout_s = context, metrics, session_timeout_s
        self.answer: asyncio.Future = asyncio.get_running_loop().create_future()  # FirstToken | ComputePrompt
        self.peer_gone = asyncio.Event()
        self.peer_reason = ""

    async def write(self, **kind) -> None:
        limit = self.session_timeout_s
        try:
            async with asyncio.timeout(limit):
                await self.context.write(pb.DecodeMessage(**kind))
        except asyncio.TimeoutError:
            raise SessionEnded(f"timed out after {limit:.1f}s writing to prefill (it stopped reading)",
                               notify=False) from None

    async def refuse(self, code: str, reason: str) -> None:
        self.metrics.refused(code)
        await self.write(refusal=pb.Refusal(code=code, reason=reason))

    async def read_rest(self) -> None:
        try:
            while True:
                msg = await self.context.read()
                if msg is grpc.aio.EOF:
                    self.peer_reason = "prefill closed the session"
                    break
                kind = msg.WhichOneof("kind")
                if kind in ("first_token", "compute_prompt") and not self.answer.done():
                    self.answer.set_result(getattr(msg, kind))
                elif kind == "cancel":
                    self.peer_reason = f"cancelled by prefill: {msg.cancel.reason}"
                    break
                elif kind == "error":
                    self.peer_reason = f"prefill error: {msg.error.reason}"
                    break
                else:
                    self.peer_reason = f"unexpected {kind} message in the session"
                    break
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, RuntimeError) as exc:
            self.peer_reason = f"session stream broke: {exc}"
        finally:
            self.peer_gone.set()

    async def until_peer_gone_or(self, aw, timeout: float | None, what: str):
        task = asyncio.ensure_future(aw)
        gone = asyncio.ensure_future(self.peer_gone.wait())
        try:
            done, _ = await asyncio.wait({task, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # we are cancelled (the RPC ended): take the inner work down too
            task.cancel()
            raise
        finally:
            gone.cancel()
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.wait({task})  # let it finish its own clean-up (never raises)
        if gone in done:
            raise SessionEnded(self.peer_reason or "prefill went away", notify=False)
        raise SessionEnded(f"timed out after {timeout:.1f}s waiting for {what}")

    async def try_write_error(self, reason: str, code: str = "") -> None:
        try:
            await self.write(error=pb.Error(reason=reason, code=code))
        except Exception:  # noqa: BLE001 - the stream may already be gone
            pass
