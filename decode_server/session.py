"""The decode end of the Session stream: one ``DecodeSession`` per request.

Request lifecycle on decode (each step is a method below):

1. **admit** - the first message must be ``Start``; refuse (``Refusal`` with a code and a
   reason, then end the stream) on a protocol version or compatibility mismatch, while
   draining, when prompt + max_tokens exceed the context, when the request needs more
   blocks than the whole pool (``too_large``) or when the engine cannot reserve them now
   (``out_of_blocks``: transient, prefill may wait and retry).
2. **allocate** - the engine reserves the blocks for prompt + max_tokens (a P/D request
   is never preempted later: its blocks are held from here to the end); the CacheStore
   receiver is told to expect the prompt's blocks; ``Allocation`` (block ids + receiver
   endpoint) goes back to prefill.
3. **transfer** - KV layers arrive over the CacheStore while prefill computes; prefill's
   ``FirstToken`` arrives on the stream once every layer was sent. Both must be in before
   the session timeout (set by prefill in ``Start``, capped by ours). Then the CacheStore
   entry is deleted at once: the blocks now belong to the engine alone (they are freed by
   the engine when the request finishes, and may be re-expected for another request).
4. **decode** - the request joins the continuous batch (``add_prefilled``); every engine
   output becomes a ``Tokens`` message, the last one is followed by ``Finish``.
5. **release** - always, whatever happened (finish, ``Cancel``/``Error`` from prefill, the
   stream breaking, a timeout, our own error): abort the request in the engine if it is
   still running, release its blocks, delete its CacheStore entry, forget the session.

Who frees what: decode frees its own blocks and CacheStore entry in step 5; it never
relies on prefill to tell it (a dead prefill tells nothing).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from pdserve.protos import session_pb2 as pb
from pdserve.protos.version import PROTOCOL_VERSION

log = logging.getLogger(__name__)

# Compat fields that must be equal on both ends for KV bytes to be meaningful.
COMPAT_FIELDS = ("dtype", "num_layers", "num_kv_heads", "head_dim", "block_size", "model", "transport")


class SessionEnded(Exception):
    """The session must end now; ``reason`` says why (sent to prefill as Error when possible)."""

    def __init__(self, reason: str, notify: bool = True):
        super().__init__(reason)
        self.reason, self.notify = reason, notify


@dataclass(slots=True)
class SessionInfo:
    """What /health shows about one live session."""

    request_id: str
    stage: str
    started: float = field(default_factory=time.monotonic)
    num_blocks: int = 0


def compat_mismatch(ours: pb.Compat, theirs: pb.Compat) -> str | None:
    """None when compatible, else a message naming every differing field with both values."""
    diffs = [
        f"{name}: prefill={getattr(theirs, name)!r} decode={getattr(ours, name)!r}"
        for name in COMPAT_FIELDS
        if getattr(ours, name) != getattr(theirs, name)
    ]
    return "incompatible KV layout: " + ", ".join(diffs) if diffs else None


class DecodeSession:
    """Runs steps 1-5 for one Session call. ``server`` is the DecodeService (engine, receiver, registry)."""

    def __init__(self, server, context: grpc.aio.ServicerContext):
        self.server, self.context = server, context
        self.request_id: str | None = None
        self.reserved = False
        self.expected = False
        self.first_token: asyncio.Future = asyncio.get_running_loop().create_future()
        self.peer_gone = asyncio.Event()
        self.peer_reason = ""
        self.info: SessionInfo | None = None
        self.outcome = ("error", "error")  # (outcome, reason) for the requests counter

    # -- helpers ---------------------------------------------------------------------------
    async def _write(self, **kind) -> None:
        await self.context.write(pb.DecodeMessage(**kind))

    async def _refuse(self, code: str, reason: str) -> None:
        self.server.metrics_refusal(code)
        log.info("refused %s: %s", self.request_id, reason)
        await self._write(refusal=pb.Refusal(code=code, reason=reason))

    async def _read_rest(self) -> None:
        """Reader task: FirstToken resolves the future; Cancel/Error/EOF/broken stream end the session."""
        try:
            while True:
                msg = await self.context.read()
                if msg is grpc.aio.EOF:
                    self.peer_reason = "prefill closed the session"
                    break
                kind = msg.WhichOneof("kind")
                if kind == "first_token" and not self.first_token.done():
                    self.first_token.set_result(msg.first_token)
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

    async def _until_peer_gone_or(self, aw, timeout: float | None, what: str):
        """Await ``aw`` unless prefill goes away or the timeout passes first (``aw`` is then cancelled)."""
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

    # -- the lifecycle -----------------------------------------------------------------------
    async def run(self) -> None:
        srv = self.server
        reader = arrivals = None
        try:
            first = await asyncio.wait_for(self.context.read(), timeout=srv.session_timeout_s)
            if first is grpc.aio.EOF or first.WhichOneof("kind") != "start":
                return
            start = first.start
            self.request_id = start.request_id
            if not await self._admit(start):
                return
            reader = asyncio.ensure_future(self._read_rest())
            timeout = min(start.timeout_s or srv.session_timeout_s, srv.session_timeout_s)
            deadline = time.monotonic() + timeout
            self.info.stage = "transfer"
            arrivals = asyncio.ensure_future(self._record_layer_arrivals(timeout))
            first_token = await self._until_peer_gone_or(self.first_token, timeout, "the first token")
            remaining = max(0.01, deadline - time.monotonic())
            await self._until_peer_gone_or(srv.receiver.wait_all(self.request_id, remaining), remaining + 0.5, "the KV layers")
            # The KV is in the blocks: unpin the CacheStore entry now, before the engine can
            # finish the request and hand its blocks to another request's expect().
            srv.receiver.delete(self.request_id)
            self.expected = False
            srv.observe_kv_in(time.monotonic() - self.info.started, len(start.prompt_token_ids))
            if first_token.finished:
                await self._write(finish=pb.Finish(finish_reason=first_token.finish_reason or "stop", completion_tokens=1))
                self.outcome = ("ok", first_token.finish_reason or "stop")
                return
            self.info.stage = "decode"
            await self._until_peer_gone_or(self._decode(start, first_token.token_id), None, "decoding")
        except SessionEnded as exc:
            log.info("session %s ended: %s", self.request_id, exc.reason)
            self.outcome = ("error", "timeout" if "timed out" in exc.reason else "error") if exc.notify else ("cancelled", "prefill_gone")
            if exc.notify:
                await self._try_write_error(exc.reason)
        except asyncio.CancelledError:
            self.outcome = ("cancelled", "prefill_gone")
            raise
        except asyncio.TimeoutError:
            log.info("session: no Start within %.1fs", srv.session_timeout_s)
        except Exception as exc:  # the engine or the receiver failed: tell prefill, then clean up
            log.exception("session %s failed", self.request_id)
            await self._try_write_error(f"decode failed: {type(exc).__name__}: {exc}")
        finally:
            if reader is not None:
                reader.cancel()
            if arrivals is not None:
                arrivals.cancel()
            await self._release()

    async def _record_layer_arrivals(self, timeout: float) -> None:
        """Monotonic time each KV layer arrived (subscribing per layer), kept for /debug/requests."""
        srv, times = self.server, []
        srv.remember_arrivals(self.request_id, times)
        try:
            for layer in range(srv.compat.num_layers):
                await srv.receiver.load(self.request_id, layer, timeout)
                times.append(time.monotonic())
        except Exception:  # noqa: BLE001 - failures are handled by the session itself
            pass

    async def _try_write_error(self, reason: str) -> None:
        try:
            await self._write(error=pb.Error(reason=reason))
        except Exception:  # noqa: BLE001 - the stream may already be gone
            pass

    async def _admit(self, start: pb.Start) -> bool:
        srv = self.server
        rid = start.request_id
        if not rid:
            await self._refuse("bad_request", "Start has no request_id")
            return False
        if start.protocol_version != PROTOCOL_VERSION:
            await self._refuse("version", f"protocol version: prefill={start.protocol_version} decode={PROTOCOL_VERSION}")
            return False
        mismatch = compat_mismatch(srv.compat, start.compat)
        if mismatch:
            await self._refuse("incompatible", mismatch)
            return False
        if srv.draining:
            await self._refuse("draining", "decode is draining (shutting down)")
            return False
        if rid in srv.sessions:
            await self._refuse("bad_request", f"request id {rid!r} already has a session on this decode")
            return False
        n_prompt, max_tokens = len(start.prompt_token_ids), start.sampling.max_tokens
        if n_prompt == 0 or max_tokens < 1 or n_prompt + max_tokens > srv.max_model_len:
            await self._refuse(
                "bad_request",
                f"prompt of {n_prompt} tokens + max_tokens {max_tokens} does not fit the context of {srv.max_model_len}",
            )
            return False
        if start.blocks_needed != -(-n_prompt // srv.compat.block_size):
            await self._refuse("bad_request", f"blocks_needed {start.blocks_needed} does not match {n_prompt} prompt tokens "
                                              f"in blocks of {srv.compat.block_size}")
            return False
        need = -(-(n_prompt + max_tokens) // srv.compat.block_size)
        if need > srv.llm.num_blocks:  # can never fit here: prefill should not wait for it
            await self._refuse("too_large", f"request needs {need} KV blocks ({n_prompt} prompt tokens + max_tokens "
                                            f"{max_tokens}) but this decode has only {srv.llm.num_blocks} in all")
            return False
        try:
            block_ids = await srv.reserve(rid, n_prompt, max_tokens)
        except srv.out_of_blocks_error as exc:  # busy now; blocks free up as requests finish
            await self._refuse("out_of_blocks", getattr(exc, "reason", str(exc)))
            return False
        except ValueError as exc:  # prompt too long, bad ids: nothing was reserved
            await self._refuse("bad_request", str(exc))
            return False
        self.reserved = True
        self.info = SessionInfo(rid, "allocate", num_blocks=len(block_ids))
        srv.sessions[rid] = self.info
        prompt_blocks = list(block_ids[: start.blocks_needed])
        timeout = min(start.timeout_s or srv.session_timeout_s, srv.session_timeout_s)
        for_sender = srv.receiver.expect(rid, prompt_blocks, timeout)
        self.expected = True
        await self._write(allocation=pb.Allocation(block_ids=list(for_sender), cachestore_endpoint=srv.receiver.endpoint))
        return True

    async def _decode(self, start: pb.Start, first_token: int) -> None:
        srv = self.server
        produced = 1
        outputs = srv.add_prefilled(self.request_id, list(start.prompt_token_ids), first_token, start.sampling)
        try:
            async for out in outputs:
                if out.error:
                    raise SessionEnded(f"decode engine failed: {out.error}")
                if out.new_token_ids:
                    produced += len(out.new_token_ids)
                    await self._write(tokens=pb.Tokens(token_ids=list(out.new_token_ids)))
                if out.finished:
                    await self._write(finish=pb.Finish(finish_reason=out.finish_reason or "stop", completion_tokens=produced))
                    self.outcome = ("ok", out.finish_reason or "stop")
                    return
        finally:
            await outputs.aclose()  # an unfinished stream aborts the request in the engine
        raise SessionEnded("the engine stopped the request without finishing it")

    async def _release(self) -> None:
        """Step 5. Synchronous parts first: this runs in ``finally`` of a possibly cancelled
        task, and a second cancellation must not skip any of it; the engine abort is shielded."""
        srv, rid = self.server, self.request_id
        if rid is None:
            return
        was_receiving = self.expected
        if self.expected:
            srv.receiver.delete(rid)
            self.expected = False
        if self.info is not None and srv.sessions.get(rid) is self.info:
            del srv.sessions[rid]
            srv.count_request(*self.outcome)
        if self.reserved:
            release = asyncio.ensure_future(self._free_blocks(rid, was_receiving))
            try:
                await asyncio.shield(release)
            except asyncio.CancelledError:
                pass  # the shielded release still completes on the loop

    async def _free_blocks(self, rid: str, was_receiving: bool) -> None:
        """Give the request's blocks back to the engine, but only once no KV frame can still
        land in them (a frame cut off by delete stops within one piece)."""
        srv = self.server
        if was_receiving:
            try:
                await srv.receiver.released(rid, 5.0)
            except Exception as exc:  # noqa: BLE001 - still free them; log why it took so long
                log.warning("request %s: %s", rid, exc)
        await srv.release(rid)
