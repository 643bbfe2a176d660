"""The router's gRPC API: ``Generator.Generate``, relayed to the prefill ``Router.decide`` picks.

The request message goes to the prefill untouched and its responses come back one by one, so
a prefill's status (INVALID_ARGUMENT for bad input, UNAVAILABLE, ABORTED, DEADLINE_EXCEEDED)
reaches the client with its own message. The prompt is looked up in the index as the prefill
will compute it (``prompt_token_ids``, else the encoded ``prompt``). A prefill that answers
UNAVAILABLE before its first response (it cannot be reached, or cannot take the request) is
skipped for the next in the ranking (at most ``max_attempts``); none routable: UNAVAILABLE.
The client's deadline travels with the relayed call; a client that cancels cancels this
coroutine, which cancels the relayed call, so the prefill frees the request.
"""

from __future__ import annotations

import logging
import time

import grpc

from pdserve.protos import generate_pb2 as gpb
from pdserve.protos import generate_pb2_grpc as gpb_grpc

log = logging.getLogger(__name__)


class RouterGenerateServicer(gpb_grpc.GeneratorServicer):
    def __init__(self, router, metrics, max_attempts: int = 2):
        self.router, self.metrics, self.max_attempts = router, metrics, max_attempts
        self.in_flight = 0

    def _prompt_ids(self, request: gpb.GenerateRequest) -> list[int] | None:
        if request.prompt_token_ids:
            return list(request.prompt_token_ids)
        if request.prompt:
            return self.router.tokenizer.encode(request.prompt)
        return None  # the prefill says what is missing

    async def Generate(self, request: gpb.GenerateRequest, context: grpc.aio.ServicerContext):
        start, m = time.perf_counter(), self.metrics
        ids = self._prompt_ids(request)
        choice = self.router.decide(ids)
        m.router_overhead.observe(time.perf_counter() - start)
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
                call = watch.generator.Generate(request, timeout=context.time_remaining())
                watch.in_flight += 1
                sent = False
                try:
                    async for response in call:
                        if not sent:
                            m.ttft.observe(time.perf_counter() - start)
                            sent = True
                        yield response
                    outcome, reason = "ok", "relayed"
                    return
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.UNAVAILABLE and not sent:
                        log.warning("prefill %s unavailable (%s); trying the next one", address, exc.details())
                        continue
                    outcome, reason = "error", f"grpc_{exc.code().name.lower()}"
                    await context.abort(exc.code(), exc.details() or f"prefill {address}: {exc.code().name}")
                finally:
                    call.cancel()  # no-op when it ended; else the prefill sees the client leave
                    watch.in_flight -= 1
            outcome, reason = "error", "prefill_unreachable"
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"no prefill could take the request (tried {', '.join(tried) or 'none routable'})")
        finally:
            self.in_flight -= 1
            m.e2e_latency.observe(time.perf_counter() - start)
            m.requests.labels(outcome=outcome, reason=reason).inc()
