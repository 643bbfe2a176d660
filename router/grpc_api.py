"""The router's gRPC API: ``Generator.Generate``, relayed to the prefill ``Router.decide`` picks.

The request message goes to the prefill untouched and its responses come back one by one, so
a prefill's status (INVALID_ARGUMENT for bad input, UNAVAILABLE, ABORTED, DEADLINE_EXCEEDED)
reaches the client with its own message. The prompt is looked up in the index as the prefill
will compute it (``prompt_token_ids``, else the encoded ``prompt``). Which prefill, the retries and
the in-flight counts are ``relay.py``'s (shared with the HTTP API). A prefill whose call ends
UNAVAILABLE before its first response (it cannot be reached, or cannot take the request), or
UNKNOWN / INTERNAL (it went away: a reset connection loses the responses still in the socket, and
gRPC then says "Stream removed"), is skipped for the next in the ranking (at most
``max_attempts``; nothing reached the client, so the request goes whole); none routable: the
request waits for one up to ``prefill_wait_s`` (and its deadline), then UNAVAILABLE naming the
last failure.

Streams that outlive their prefill (the contract: ``pdserve.stream_resume``): a prefill that goes away
after part of the stream reached the client (its call ends UNAVAILABLE, UNKNOWN or INTERNAL, statuses a
prefill never gives itself once tokens went out: it died, or was drained) has the stream resumed on another
(``relay.Relay.next_resume``: never one that failed the request, waiting up to ``prefill_wait_s``): the
original request with ``resume_token_ids`` (every token the client got) and the stream's ``request_id``;
its responses go on to the client after a check that each continues the stream (the same request id,
``completion_tokens`` counting the tokens before it: a prefill that ignored the field fails the check and
nothing of it is relayed). A break there resumes again. When none can continue it, the call ends with the
broken prefill's status and a message saying why it was not resumed. A prefill's own verdict mid-stream
(ABORTED: its decode failed; DEADLINE_EXCEEDED) is relayed as before. Metric:
``pdserve_router_resumes_total{outcome}``.

The client's deadline travels with the relayed call; a client that cancels cancels this
coroutine, which cancels the relayed call, so the prefill frees the request. With an SLO queue
(``slo_gate.py``) the request first waits its turn there (metadata ``x-slo-class``, which also
goes on to the prefill; 429 RESOURCE_EXHAUSTED / DEADLINE_EXCEEDED from the queue itself).
"""

from __future__ import annotations

import logging
import uuid
from contextlib import aclosing

import grpc

from pdserve.defaults import PREFILL_WAIT_S, REQUEST_TIMEOUT_S
from pdserve.protos import generate_pb2 as gpb
from pdserve.protos import generate_pb2_grpc as gpb_grpc
from pdserve.slo import HEADER, Rejected

from .relay import Relays
from .resume import StreamCut
from .slo_gate import GateTimeout, SloGate

SLO_METADATA = HEADER.lower()  # x-slo-class: gRPC metadata naming the request's SLO class, relayed to the prefill
# a relayed call's statuses after tokens went out that say its prefill went away (a prefill's own are others)
WENT_AWAY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
log = logging.getLogger(__name__)


class RouterGenerateServicer(gpb_grpc.GeneratorServicer):
    def __init__(self, router, metrics, max_attempts: int = 2, gate: SloGate | None = None,
                 request_timeout_s: float = REQUEST_TIMEOUT_S, prefill_wait_s: float = PREFILL_WAIT_S,
                 relays: Relays | None = None):
        """``relays``: shared with the router's HTTP API (``relay.py``); None: its own, of ``max_attempts``
        prefills per ranking and ``prefill_wait_s`` to wait for a routable one."""
        self.router, self.metrics = router, metrics
        self.gate, self.request_timeout_s = gate, request_timeout_s  # the SLO queue (slo_gate.py), or None
        self.relays = relays or Relays(router, metrics, max_attempts, prefill_wait_s)

    @property
    def in_flight(self) -> int:
        """gRPC requests being relayed now."""
        return self.relays.in_flight["grpc"]

    def _prompt_ids(self, request: gpb.GenerateRequest) -> list[int] | None:
        if request.prompt_token_ids:
            return list(request.prompt_token_ids)
        if request.prompt and self.router.tokenizer is not None:  # None: not loaded yet; routed by load alone
            return self.router.tokenizer.encode(request.prompt)
        return None  # the prefill says what is missing

    async def Generate(self, request: gpb.GenerateRequest, context: grpc.aio.ServicerContext):
        ids = self._prompt_ids(request)
        if self.gate is None:
            async with aclosing(self._relay(request, context, ids, None)) as responses:
                async for response in responses:
                    yield response
            return
        header = dict(context.invocation_metadata() or ()).get(SLO_METADATA)
        try:
            cls = self.gate.classes.select(header)
        except ValueError as exc:
            self.metrics.requests.labels(outcome="error", reason="bad_request").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        remaining = context.time_remaining()
        timeout_s = self.request_timeout_s if remaining is None else min(remaining, self.request_timeout_s)
        try:
            async with self.gate.admission(f"router-{uuid.uuid4().hex}", cls, len(ids or ()),
                                           request.max_tokens or 16, timeout_s) as passage:
                async with aclosing(self._relay(request, context, ids, passage)) as responses:
                    async for response in responses:
                        passage.tokens(len(response.token_ids))
                        yield response
        except Rejected as exc:
            self.metrics.requests.labels(outcome="error", reason="slo_rejected").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except GateTimeout as exc:
            self.metrics.requests.labels(outcome="error", reason="timeout").inc()
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))

    async def _relay(self, request: gpb.GenerateRequest, context: grpc.aio.ServicerContext, ids, passage):
        """The request through the prefills (``relay.py``: rank -> try prefill -> stream / retry / resume / give up)."""
        relay = self.relays.open("grpc", ids, context.time_remaining(), passage)
        if not await relay.rank():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no prefill is routable")
        upstream = _Upstream(request, context)
        try:
            async for response in self._relayed(relay, upstream):
                yield response
        except _Abort as end:  # the request is counted and released first: then the client gets its status
            await context.abort(end.code, end.details)

    async def _relayed(self, relay, upstream: _Upstream):
        """``_relay``'s responses, the whole of the request's passage (``with relay``); a call that must end with
        a status raises ``_Abort`` once the request's outcome is set."""
        last = ""
        with relay:
            while (attempt := await relay.next_attempt()) is not None:
                with attempt:
                    attempt.count()
                    try:
                        async with aclosing(upstream.responses(attempt.watch)) as responses:
                            async for response in responses:
                                relay.replied()
                                yield response
                        relay.finish("ok", "relayed")
                        return
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() in WENT_AWAY and not upstream.sent:
                            log.warning("prefill %s failed before its first response (%s); trying the next one",
                                        attempt.address, _why(exc))
                            last = f"; last: {attempt.address}: {_why(exc)}"
                            continue
                        if not (exc.code() in WENT_AWAY and upstream.sent):  # the prefill's own answer
                            relay.finish("error", f"grpc_{exc.code().name.lower()}")
                            raise _Abort(exc.code(), exc.details() or f"prefill {attempt.address}: {exc.code().name}")
                        log.warning("prefill %s failed mid-stream: %s", attempt.address, _why(exc))
                        attempt.broke()
                        broke = exc
                # the prefill went away after part of the stream reached the client
                async with aclosing(self._after_break(relay, upstream, attempt.address, broke)) as responses:
                    async for response in responses:
                        yield response
                return
            relay.finish("error", "prefill_unreachable")
            raise _Abort(grpc.StatusCode.UNAVAILABLE,
                         f"no prefill could take the request (tried {relay.tried_text()}{last})")

    async def _after_break(self, relay, upstream: _Upstream, address: str, broke: grpc.aio.AioRpcError):
        """Resume the stream on another prefill (``relay.next_resume``), response by response; or end the call
        (``_Abort``) with the broken prefill's status, why it was not resumed in its message."""
        resumable = upstream.can_resume
        why_not = None if resumable else "the stream cannot be resumed"
        if upstream.finished:  # only the call's status was missing: the client has the whole stream
            relay.finish("ok", "relayed")
            return
        while why_not is None:
            attempt = await relay.next_resume(upstream.token_ids)
            if attempt is None:
                why_not = relay.gave_up
                break
            log.info("resuming a gRPC stream on %s after %d tokens", attempt.address, len(upstream.token_ids))
            with attempt:
                attempt.count()
                try:
                    async with aclosing(upstream.responses(attempt.watch, resumed=True)) as responses:
                        async for response in responses:
                            yield response
                    break
                except (grpc.aio.AioRpcError, StreamCut) as exc:
                    if isinstance(exc, grpc.aio.AioRpcError) and upstream.resumed_sent and exc.code() not in WENT_AWAY:
                        relay.resumed(None)  # it went on, then gave its own verdict: relayed, as the first's
                        relay.finish("error", f"grpc_{exc.code().name.lower()}")
                        raise _Abort(exc.code(), exc.details() or f"prefill {attempt.address}")
                    attempt.broke(f"{attempt.address}: {_why(exc)}")
                    log.warning("prefill %s failed resuming a gRPC stream: %s", attempt.address, _why(exc))
                    if upstream.finished:  # its finish response went out: the client has the whole stream
                        break
        relay.resumed(why_not, resumable)
        if why_not is not None:
            message = f"prefill {address} failed mid-stream: {_why(broke)}"
            log.warning("%s; not resumed: %s", message, why_not)
            raise _Abort(broke.code(), f"{message}; not resumed: {why_not}")


class _Abort(Exception):
    """The status a relayed call ends with, raised inside the request's passage and given to the client after it."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class _Upstream:
    """The relayed call(s) of one request, as the client sees them: the responses that went out, their tokens,
    the stream's request id; ``responses(watch)`` relays one prefill's call (the next prefill's, after
    ``resumed``: with the tokens sent, under the same request id, each response checked against them)."""

    def __init__(self, request: gpb.GenerateRequest, context: grpc.aio.ServicerContext):
        self.request, self.context = request, context
        self.slo = [(k, v) for k, v in (context.invocation_metadata() or ()) if k == SLO_METADATA] or None
        self.sent = 0  # responses that went out
        self.resumed_sent = 0  # of the current resumed call
        self.token_ids: list[int] = []
        self.request_id = ""
        self.finished = False

    @property
    def can_resume(self) -> bool:
        return bool(self.token_ids) and bool(self.request_id) and not self.finished

    async def responses(self, watch, resumed: bool = False):
        request = self.request
        if resumed:
            request = gpb.GenerateRequest()
            request.CopyFrom(self.request)
            request.request_id = self.request_id
            request.resume_token_ids[:] = self.token_ids
            self.resumed_sent = 0
        call = watch.generator.Generate(request, timeout=self.context.time_remaining(), metadata=self.slo)
        try:
            async for response in call:
                if resumed:
                    self._check(response)
                    self.resumed_sent += 1
                self.sent += 1
                self.token_ids += response.token_ids
                self.request_id = self.request_id or response.request_id
                self.finished = bool(response.finish_reason)
                yield response
            if resumed and not self.finished:
                raise StreamCut("the resumed stream ended without its finish response")
        finally:
            call.cancel()  # no-op when it ended; else the prefill sees the client leave

    def _check(self, response: gpb.GenerateResponse) -> None:
        """A resumed call's response continues the stream (a prefill that ignored ``resume_token_ids`` does not)."""
        if response.request_id != self.request_id or \
                response.completion_tokens != len(self.token_ids) + len(response.token_ids):
            raise StreamCut(f"a response that does not continue the stream (request_id {response.request_id!r}, "
                            f"completion_tokens {response.completion_tokens} after {len(self.token_ids)} tokens)")


def _why(exc: Exception) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
