"""The router's gRPC API: ``Generator.Generate``, relayed to the prefill ``Router.decide`` picks.

The request message goes to the prefill untouched and its responses come back one by one, so
a prefill's status (INVALID_ARGUMENT for bad input, UNAVAILABLE, ABORTED, DEADLINE_EXCEEDED)
reaches the client with its own message. The prompt is looked up in the index as the prefill
will compute it (``prompt_token_ids``, else the encoded ``prompt``). A prefill that answers
UNAVAILABLE before its first response (it cannot be reached, or cannot take the request) is
skipped for the next in the ranking (at most ``max_attempts``); none routable: the request waits
for one up to ``prefill_wait_s`` (and its deadline), then UNAVAILABLE.
The client's deadline travels with the relayed call; a client that cancels cancels this
coroutine, which cancels the relayed call, so the prefill frees the request. With an SLO queue
(``slo_gate.py``) the request first waits its turn there (metadata ``x-slo-class``, which also
goes on to the prefill; 429 RESOURCE_EXHAUSTED / DEADLINE_EXCEEDED from the queue itself).
"""

from __future__ import annotations

import logging
import time
import uuid

import grpc

from pdserve.defaults import PREFILL_WAIT_S, REQUEST_TIMEOUT_S
from pdserve.protos import generate_pb2 as gpb
from pdserve.protos import generate_pb2_grpc as gpb_grpc
from pdserve.slo import HEADER, Rejected

from .slo_gate import GateTimeout, SloGate

SLO_METADATA = HEADER.lower()  # x-slo-class: gRPC metadata naming the request's SLO class, relayed to the prefill
log = logging.getLogger(__name__)


class RouterGenerateServicer(gpb_grpc.GeneratorServicer):
    def __init__(self, router, metrics, max_attempts: int = 2, gate: SloGate | None = None,
                 request_timeout_s: float = REQUEST_TIMEOUT_S, prefill_wait_s: float = PREFILL_WAIT_S):
        self.router, self.metrics, self.max_attempts = router, metrics, max_attempts
        self.prefill_wait_s = prefill_wait_s  # how long a request waits for a routable prefill
        self.gate, self.request_timeout_s = gate, request_timeout_s  # the SLO queue (slo_gate.py), or None
        self.in_flight = 0

    def _prompt_ids(self, request: gpb.GenerateRequest) -> list[int] | None:
        if request.prompt_token_ids:
            return list(request.prompt_token_ids)
        if request.prompt and self.router.tokenizer is not None:  # None: not loaded yet; routed by load alone
            return self.router.tokenizer.encode(request.prompt)
        return None  # the prefill says what is missing

    async def Generate(self, request: gpb.GenerateRequest, context: grpc.aio.ServicerContext):
        ids = self._prompt_ids(request)
        if self.gate is None:
            async for response in self._relay(request, context, ids, None):
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
                async for response in self._relay(request, context, ids, passage):
                    passage.tokens(len(response.token_ids))
                    yield response
        except Rejected as exc:
            self.metrics.requests.labels(outcome="error", reason="slo_rejected").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except GateTimeout as exc:
            self.metrics.requests.labels(outcome="error", reason="timeout").inc()
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))

    async def _relay(self, request: gpb.GenerateRequest, context: grpc.aio.ServicerContext, ids, passage):
        start, m = time.perf_counter(), self.metrics
        choice = self.router.decide(ids)
        m.router_overhead.observe(time.perf_counter() - start)
        if choice is None:
            remaining = context.time_remaining()
            wait = self.prefill_wait_s if remaining is None else min(self.prefill_wait_s, remaining)
            choice = await self.router.decide_waiting(ids, time.monotonic() + wait)
        if choice is None:
            m.requests.labels(outcome="error", reason="no_prefill").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no prefill is routable")
        self.in_flight += 1
        outcome, reason, tried = "cancelled", "client_disconnected", []
        try:
            for attempt, address in enumerate(choice.ranking[: self.max_attempts]):
                watch = self.router.prefills.watches.get(address)
                if watch is None or not watch.routable():
                    continue
                tried.append(address)
                self.router.count_decision(address, choice.reason if attempt == 0 else "retry", choice, ids)
                slo = [(k, v) for k, v in (context.invocation_metadata() or ()) if k == SLO_METADATA]
                call = watch.generator.Generate(request, timeout=context.time_remaining(), metadata=slo or None)
                watch.in_flight += 1
                sent = False
                try:
                    async for response in call:
                        if not sent:
                            m.ttft.observe(time.perf_counter() - start)
                            sent = True
                        yield response
                    outcome, reason = "ok", "relayed"
                    if passage is not None:
                        passage.outcome = "ok"
                    return
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.UNAVAILABLE and not sent:
                        log.warning("prefill %s unavailable (%s); trying the next one", address, exc.details())
                        continue
                    outcome, reason = "error", f"grpc_{exc.code().name.lower()}"
                    if passage is not None:
                        passage.outcome = "error"
                    await context.abort(exc.code(), exc.details() or f"prefill {address}: {exc.code().name}")
                finally:
                    call.cancel()  # no-op when it ended; else the prefill sees the client leave
                    watch.in_flight -= 1
            outcome, reason = "error", "prefill_unreachable"
            if passage is not None:
                passage.outcome = "error"
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"no prefill could take the request (tried {', '.join(tried) or 'none routable'})")
        finally:
            self.in_flight -= 1
            m.e2e_latency.observe(time.perf_counter() - start)
            m.requests.labels(outcome=outcome, reason=reason).inc()
