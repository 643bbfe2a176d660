"""SessionStream: the decode end of one Session stream as a stream (no engine, no KV): what it
writes, what it reads, and how every wait on prefill ends.

Contract (``DecodeSession`` builds on it; its lifecycle is in session.py):

- ``write(**kind)`` sends one DecodeMessage; a prefill that does not take it within
  ``session_timeout_s`` (it stopped reading: a frozen prefill, gRPC flow control full)
  raises ``SessionEnded`` (``End.PREFILL_STUCK``: not notified, the stream is stuck anyway).
- ``refuse(code, reason)`` counts and sends a Refusal.
- ``read_rest()`` (a task, after Start) resolves ``answer`` with prefill's decision, the
  ``FirstToken`` (its KV is on the way) or ``ComputePrompt`` (compute the prompt here); a
  Cancel, Error, end of stream, broken stream or any other message sets ``peer_gone`` with
  ``peer_reason``.
- ``until_peer_gone_or(aw, timeout, what)`` awaits ``aw`` unless prefill goes away
  (``SessionEnded`` with ``End.PREFILL_GONE``, not notified) or ``timeout`` passes
  (``End.TIMED_OUT``, naming ``what``); ``aw`` is cancelled and allowed to clean up in both cases.
- ``try_write_error(reason, code)`` tells prefill why the session ends, if it still can.
- ``write_finish(reason, tokens)`` sends the Finish; ``cancelled_labels()`` is how a session the RPC's
  end cancelled is counted: ended "ok" once its Finish was being written (the prefill closes the
  session when it reads it, which may cancel us before the write returns), prefill gone before.

Why a session ends early is an ``End`` (an enum, never read from the message's words): whether
prefill is told (``notify``) and the (outcome, reason) the requests counter counts it under
(``labels``) follow from it.
"""

from __future__ import annotations

import asyncio
import enum

import grpc

from pdserve.protos import session_pb2 as pb

from .session_metrics import SessionMetrics


class End(enum.Enum):
    """Why a session ended before its Finish."""

    FAILED = "failed"  # our engine, a KV lender or the protocol failed: prefill is told
    TIMED_OUT = "timed_out"  # prefill's answer or the KV did not come in time: prefill is told
    PREFILL_GONE = "prefill_gone"  # prefill cancelled, failed, closed or broke the stream
    PREFILL_STUCK = "prefill_stuck"  # prefill stopped reading our writes (frozen, flow control full)

    @property
    def notify(self) -> bool:
        """Whether prefill is sent an Error (not when it is gone or stuck: nobody would read it)."""
        return self in (End.FAILED, End.TIMED_OUT)

    @property
    def labels(self) -> tuple[str, str]:
        """(outcome, reason) of ``SessionMetrics.request_done``."""
        return _LABELS[self]


_LABELS = {End.FAILED: ("error", "error"), End.TIMED_OUT: ("error", "timeout"),
           End.PREFILL_GONE: ("cancelled", "prefill_gone"), End.PREFILL_STUCK: ("cancelled", "prefill_gone")}


class SessionEnded(Exception):
    """The session must end now; ``reason`` says why in words (sent to prefill as Error when
    ``end.notify``), ``end`` says why as an ``End``."""

    def __init__(self, reason: str, end: End = End.FAILED):
        super().__init__(reason)
        self.reason, self.end = reason, end

    @property
    def notify(self) -> bool:
        return self.end.notify


class SessionStream:
    def __init__(self, context: grpc.aio.ServicerContext, metrics: SessionMetrics, session_timeout_s: float):
        self.context, self.metrics, self.session_timeout_s = context, metrics, session_timeout_s
        self.answer: asyncio.Future = asyncio.get_running_loop().create_future()  # FirstToken | ComputePrompt
        self.peer_gone = asyncio.Event()
        self.peer_reason = ""
        self.finishing = ""  # the Finish's finish_reason once its write began

    async def write(self, **kind) -> None:
        limit = self.session_timeout_s
        try:
            async with asyncio.timeout(limit):
                await self.context.write(pb.DecodeMessage(**kind))
        except asyncio.TimeoutError:
            raise SessionEnded(f"timed out after {limit:.1f}s writing to prefill (it stopped reading)",
                               End.PREFILL_STUCK) from None

    async def write_finish(self, reason: str, completion_tokens: int) -> None:
        """Send the Finish. The prefill closes the session as soon as it reads it, and that can cancel
        us while this write is still awaited: ``cancelled_labels`` then counts the request as ended."""
        self.finishing = reason
        await self.write(finish=pb.Finish(finish_reason=reason, completion_tokens=completion_tokens))

    def cancelled_labels(self) -> tuple[str, str]:
        """(outcome, reason) of a session whose RPC ended under it: ("ok", its finish_reason) once the
        Finish was being written (a completed request, not a lost one), prefill gone before that."""
        return ("ok", self.finishing) if self.finishing else End.PREFILL_GONE.labels

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
            raise SessionEnded(self.peer_reason or "prefill went away", End.PREFILL_GONE)
        raise SessionEnded(f"timed out after {timeout:.1f}s waiting for {what}", End.TIMED_OUT)

    async def try_write_error(self, reason: str, code: str = "") -> None:
        try:
            await self.write(error=pb.Error(reason=reason, code=code))
        except Exception:  # noqa: BLE001 - the stream may already be gone
            pass
