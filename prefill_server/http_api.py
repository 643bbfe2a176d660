"""The prefill server's HTTP API (aiohttp): OpenAI-compatible endpoints plus probes.

| route                        | answer                                                       |
|------------------------------|--------------------------------------------------------------|
| POST /v1/completions         | text completion; ``stream: true`` -> SSE chunks + ``[DONE]`` (below) |
| POST /v1/chat/completions    | chat completion; same streaming rules                        |
| GET  /v1/models              | the one served model                                         |
| GET  /health                 | 200 + JSON counters (sessions, KV blocks, CacheStore entries) |
| GET  /ready                  | 200 when a decode is routable or local fallback is on, else 503 |
| GET  /metrics                | Prometheus text                                              |
| GET  /debug/requests/{id}    | monotonic timestamps of a recent P/D request (tests, tuning) |
| GET  /debug/requests         | the same for every recent P/D request, oldest first (a timeline)  |
| GET  /debug/threads         | CPU seconds of each of this process's threads (``pdserve/thread_cpu.py``) |
| GET  /debug/slo?recent=N     | the SLO queue: policy, waiting by class, estimator, the last N estimates vs actuals |
| /v1/files, /v1/batches       | the OpenAI Batch API (``pdserve.batch.api``, added by ``cli.py``) |
| GET  /tokenizer              | the model's config and tokenizer files, for a router (``tokenizer_api.py``, added by ``cli.py``) |
| POST /tokenize, /detokenize  | vLLM's routes: a prompt's (or a chat's) token ids, ids' text (``tokenize_api.py``, added by ``cli.py``) |

Choices: a request has (prompts on /v1/completions) x ``n`` choices, choice ``p * n + j`` the
j-th sample of prompt p (``choices.py``), each its own sequence over P/D; ``usage`` sums them
(each prompt's tokens counted once). With ``echo`` a choice's text starts with its prompt's;
with ``logprobs`` each token carries its logprob (``openai_logprobs.py``); ``response_format``
holds the output to JSON / a JSON Schema (engine/grammar.py).

Streaming (``stream: true``), per choice, as vLLM does: one event per generated token, in order, whose
``text`` (chat: ``delta.content``) is the text that token releases, ``""`` when it releases
none (the token ends inside a UTF-8 character, decodes to nothing, or might begin a stop
string: that text is held back and goes out with the event of the token that completes it);
then one event with ``finish_reason`` that carries no token, its text what was still held
back at the end (usually ``""``; chat: no ``content``); events of several choices interleave
(each has its ``index``); after the last choice's finish the usage event
(``stream_options.include_usage``) and ``data: [DONE]``. So the events without a
finish_reason number exactly ``usage.completion_tokens``, and their texts joined with the
last one's equal the non-streamed text. Chat: the first event also has ``role``. A stop
string is never sent, nor the tokens after the one that completed it.

API keys (``--api-key-file``): every route but /health, /ready and /metrics answers 401
(``invalid_api_key``) to a request without one, before its handler (``pdserve.http_auth``, installed by
``wiring.start_http``).

Errors: bad input -> 400 with an OpenAI error body (the server keeps serving); a request
that needs more KV blocks than any decode holds in all -> 413 (``request_too_large``) at
once; every decode merely full -> the request waits in the admission queue (no error),
but when ``--max-queued-requests`` already wait -> 429 (``queue_full``); an SLO class that
cannot be met even if the request were served next (a class with ``earlyReject``) -> 429 at
once, ``Retry-After`` in seconds and the estimate in the message (``slo_cannot_be_met``);
no decode and no fallback -> 503 with the reasons; a decode failing mid-stream -> an SSE event
``data: {"error": {...}}`` then ``data: [DONE]`` (non-streaming: 502).

Deadline: every request ends within ``--request-timeout`` seconds, or sooner with the
header ``X-Request-Timeout: <seconds>`` (a positive number; anything else is a 400 naming
the header; a value above ``--request-timeout`` is capped by it). When it passes, a request
that has streamed nothing yet (or is not streaming) gets 504 with an OpenAI error body
(code ``request_timeout``; the message says when it was waiting in the admission queue); a
stream gets that error as an SSE event, then ``[DONE]``. A client that disconnects
cancels its handler (``handler_cancellation``), which closes the Session (or takes the
request out of the admission queue), so the cancellation reaches decode at once.

Streams that outlive their prefill (``resume.py``, the contract in ``pdserve.stream_resume``): with
the header ``X-PDServe-Resumable: 1`` (a router sends it) the events of a stream that can be resumed
carry their token ids; the body field ``pdserve_resume`` continues a stream another prefill began
(validated: 400 naming the field). Without a router a client whose prefill dies sees its stream break.

SLO class: the header ``X-SLO-Class: <name>`` or vLLM's body field ``priority`` (the class
that declares that priority; 0 is the default class unless a class declares 0); neither:
the default class. Unknown class or priority, or both naming different classes: 400
(code ``unknown_slo_class``) naming the known classes (``pdserve.slo.classes``).
"""  # noqa: E501

from __future__ import annotations

import time

from aiohttp import web

from pdserve import thread_cpu
from pdserve.defaults import REQUEST_TIMEOUT_HEADER
from pdserve.slo import HEADER as SLO_HEADER
from pdserve.slo import Rejected

from . import openai_api as oa
from .closing import aclose_fully
from .decode_session import DecodeFailed
from .frontend import RequestTimedOut, parse_timeout_header
from .node import NoDecodeAvailable, QueueFull, RequestTooLarge
from .openai_serving import collect, sse, start
from .resume import parse_resume, resumable

TIMEOUT_HEADER = REQUEST_TIMEOUT_HEADER


def _json_error(status: int, message: str, type_: str, param=None, code=None) -> web.Response:
    return web.json_response(oa.error_body(message, type_, param, code), status=status)


# How a request that was accepted but not served fails, before its first token: exception ->
# (HTTP status, OpenAI error type, code), first match wins (QueueFull and RequestTooLarge are
# kinds of NoDecodeAvailable). The Batch API records the same answers (batch/runner.py).
FAILURES = (
    (RequestTooLarge, 413, "invalid_request_error", "request_too_large"),
    (QueueFull, 429, "overloaded_error", "queue_full"),
    (Rejected, 429, "rate_limit_error", "slo_cannot_be_met"),
    (NoDecodeAvailable, 503, "service_unavailable", "no_decode_available"),
    (DecodeFailed, 502, "server_error", "decode_failed"),
    (RequestTimedOut, 504, "timeout_error", "request_timeout"),
)
FAILURE_TYPES = tuple(f[0] for f in FAILURES)


def failure(exc: BaseException) -> tuple[int, str, str]:
    """(HTTP status, error type, code) of one of FAILURE_TYPES."""
    return next((status, type_, code) for kind, status, type_, code in FAILURES if isinstance(exc, kind))


def _failure_response(exc: BaseException) -> web.Response:
    status, type_, code = failure(exc)
    resp = _json_error(status, str(exc), type_, code=code)
    if isinstance(exc, Rejected):
        resp.headers["Retry-After"] = str(exc.retry_after_s)
    return resp


def _timings_json(rid: str, t) -> dict:
    """One request's SessionTimings as /debug/requests answers them (monotonic seconds)."""
    return {"request_id": rid, "arrived": t.arrived, "start": t.start, "allocated": t.allocated,
            "layer_stored": t.layer_stored, "prefill_done": t.prefill_done, "kv_sent": t.kv_sent, "where": t.where,
            "decode_cached_blocks": t.cached_blocks, "link_busy_s": t.link_busy_s}


class HttpApi:
    def __init__(self, frontend, health_fn, metrics=None, is_draining=lambda: False):
        self.fe, self.health_fn, self.metrics, self.is_draining = frontend, health_fn, metrics, is_draining

    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_handler)
        app.router.add_get("/debug/requests", self.debug_requests)
        app.router.add_get("/debug/requests/{rid}", self.debug_request)
        app.router.add_get("/debug/slo", self.debug_slo)
        app.router.add_get("/debug/threads", self.debug_threads)
        return app

    async def debug_slo(self, request: web.Request) -> web.Response:
        """The SLO queue: classes, policy, waiting per class, estimator, recent estimates vs actuals."""
        if self.fe.slo is None:
            return web.json_response({"error": "no SLO queue on this server"}, status=404)
        try:
            recent = int(request.query.get("recent", "64"))
        except ValueError:
            return web.json_response({"error": "recent must be an integer (finished requests to show)"}, status=400)
        return web.json_response(self.fe.slo.snapshot(recent))

    async def debug_request(self, request: web.Request) -> web.Response:
        """Monotonic timestamps of a recent P/D request (allocation, each layer stored, KV sent)."""
        rid = request.match_info["rid"]
        t = self.fe.node.last_timings.get(rid)
        if t is None:
            return web.json_response({"error": f"unknown request {rid!r}"}, status=404)
        return web.json_response(_timings_json(rid, t))

    async def debug_requests(self, request: web.Request) -> web.Response:
        """The timestamps of every recent P/D request (the node keeps the latest 256), oldest first: a
        timeline of this prefill (when each request came, was allocated, computed, sent)."""
        timings = list(self.fe.node.last_timings.items())
        return web.json_response({"now": time.monotonic(), "requests": [_timings_json(r, t) for r, t in timings]})

    async def debug_threads(self, request: web.Request) -> web.Response:
        """Each thread's CPU seconds so far and the process's (thread_cpu.snapshot)."""
        return web.json_response(thread_cpu.snapshot())

    async def models(self, request: web.Request) -> web.Response:
        model = {"id": self.fe.model_name, "object": "model", "created": 0, "owned_by": "pdserve",
                 "max_model_len": self.fe.max_model_len}
        return web.json_response({"object": "list", "data": [model]})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **self.health_fn()})

    async def ready(self, request: web.Request) -> web.Response:
        if self.is_draining():
            return web.json_response({"ready": False, "reason": "draining"}, status=503)
        if self.fe.node.ready():
            return web.json_response({"ready": True})
        return web.json_response({"ready": False, "reason": self.fe.node.why_not_ready()}, status=503)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        if self.metrics is None:
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})
        return await self.metrics.aiohttp_handler(request)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, oa.parse_completion)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, oa.parse_chat)

    async def _serve(self, request: web.Request, parse) -> web.StreamResponse:
        fe = self.fe
        try:
            body = oa.parse_json(await request.read())
            parsed = parse(body, fe.model_name, fe.max_model_len, fe.vocab_size)
            resume = parse_resume(body, parsed, fe.vocab_size)
            slo_class = fe.slo_class(request.headers.get(SLO_HEADER), body.get("priority"))
            timeout_s = parse_timeout_header(request.headers.get(TIMEOUT_HEADER), TIMEOUT_HEADER)
            n_prompt, states, pieces = start(fe, parsed, slo_class, timeout_s, resume)
        except oa.BadRequest as exc:
            if self.metrics is not None:
                self.metrics.requests.labels(outcome="error", reason="bad_request").inc()
            return _json_error(400, exc.message, "invalid_request_error", exc.param, exc.code)
        try:
            try:
                first = await pieces.__anext__()
            except FAILURE_TYPES as exc:
                return _failure_response(exc)
            except oa.BadRequest as exc:  # a choice's request id already in flight
                return _json_error(400, exc.message, "invalid_request_error", exc.param, exc.code)
            if not parsed.stream:
                return await collect(parsed, states, n_prompt, first, pieces)
            return await sse(request, parsed, states, n_prompt, first, pieces, resumable(parsed, request.headers))
        finally:
            await aclose_fully(pieces)
