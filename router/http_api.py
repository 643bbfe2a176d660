"""The router's HTTP API (aiohttp): the prefill's OpenAI routes, relayed; its own probes.

| route                        | answer                                                          |
|------------------------------|-----------------------------------------------------------------|
| POST /v1/completions         | relayed byte for byte to the prefill ``Router.decide`` picks     |
| POST /v1/chat/completions    | the same                                                        |
| GET  /v1/models              | relayed to the first routable prefill                           |
| POST /tokenize, /detokenize  | the same (vLLM's routes; the prefill's ``tokenize_api.py``)      |
| GET  /health                 | 200 + JSON: in flight (HTTP; gRPC), every prefill's load and index entry |
| GET  /ready                  | 200 when a prefill is routable (and the tokenizer loaded), else 503 |
| GET  /metrics                | Prometheus text (``ROUTER_METRICS``)                            |
| POST /debug/route?kind=K     | the decision for a completion (K=completion) or chat body, not  |
|                              | sent anywhere: prefill, reason, cached blocks, ranking          |
| GET  /debug/residence?since=N| the router's own time of each request recorded after number N   |
|                              | (its two parts: ``residence.py``; the last 4096 are kept)        |

Which prefill, the retries, the resumes and the in-flight counts are ``relay.py``'s (shared with the
gRPC API); this module speaks HTTP. The request body goes to the prefill untouched (with the headers
``X-SLO-Class``, ``X-Request-Timeout`` and ``Authorization`` (the client's API key: a prefill behind
API keys checks it too, ``pdserve.http_auth``), and ``X-PDServe-Resumable: 1``) and its status, content
type, ``Retry-After`` and body come back unchanged (SSE events as they arrive, whole, without the token ids a prefill adds to the events of
a stream the router can resume: ``resume.py``), so a 400 or a 429 is the prefill's own. A prefill that
cannot be connected to before its response starts is skipped for the next one in the
ranking (at most ``max_attempts``); so is one that answers 503 ``no_decode_available`` (it
computed nothing: during a protocol rollout its decodes leave before it does), and one that breaks
before anything of its response reached the client (a whole response is read before it is sent;
a stream is sent event by event): the request goes whole to the next prefill, never back to it.
A prefill that breaks after part of a stream went out: the stream is resumed on another prefill
(``resume.py``), else it ends with an error event (``prefill_failed``) and ``[DONE]``. No routable
prefill: the request waits for one up to ``prefill_wait_s`` (and its deadline), then gets 503
with an OpenAI error body (a prefill's own 503 if one refused it; 502 ``prefill_failed`` when the
ones tried broke). A client that disconnects cancels the handler, which closes the upstream
connection, so the prefill cancels the request as if the client had been its own.
"""  # noqa: E501

from __future__ import annotations

import json
import logging
import time
import uuid

import aiohttp
from aiohttp import hdrs, web

from pdserve.defaults import PREFILL_WAIT_S, REQUEST_TIMEOUT_HEADER, REQUEST_TIMEOUT_S
from pdserve.slo import HEADER as SLO_HEADER
from pdserve.slo import Rejected
from pdserve.stream_resume import RESUMABLE_HEADER

from .prompt import prompt_token_ids
from .relay import Relays
from .residence import REQUEST_ID_HEADER, Clock, Residences, TimedBody
from .resume import DONE, EventRelay, StreamCut, is_sse, pipe, resume
from .slo_gate import GateTimeout, SloGate, TokenCounter, deadline_s, request_class

log = logging.getLogger(__name__)
RELAYED_HEADERS = ("Content-Type", "Cache-Control", "Retry-After")
# request headers the prefill reads: SLO class, deadline, the client's API key (pdserve.http_auth)
FORWARDED_HEADERS = (SLO_HEADER, REQUEST_TIMEOUT_HEADER, hdrs.AUTHORIZATION)


def _error(status: int, message: str, code: str, type_: str = "service_unavailable") -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return web.json_response(body, status=status)


class RouterApi:
    def __init__(self, router, metrics, is_draining=lambda: False, max_attempts: int = 2, gate: SloGate | None = None,
                 request_timeout_s: float = REQUEST_TIMEOUT_S, prefill_wait_s: float = PREFILL_WAIT_S,
                 tokenizer_source=None, relays: Relays | None = None):
        """``relays``: shared with the router's gRPC API (``relay.py``); None: its own, of ``max_attempts``
        prefills per ranking and ``prefill_wait_s`` to wait for a routable one before 503."""
        self.router, self.metrics, self.is_draining = router, metrics, is_draining
        self.tokenizer_source = tokenizer_source  # a PrefillTokenizer (--tokenizer-from-prefill), or None
        self.gate, self.request_timeout_s = gate, request_timeout_s  # the SLO queue (slo_gate.py), or None
        self.relays = relays or Relays(router, metrics, max_attempts, prefill_wait_s)
        self.residences = Residences(metrics)  # the router's own time per request (residence.py)
        self.session: aiohttp.ClientSession | None = None

    @property
    def in_flight(self) -> int:
        """HTTP requests being relayed now."""
        return self.relays.in_flight["http"]

    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.first_prefill)
        app.router.add_post("/tokenize", self.first_prefill)
        app.router.add_post("/detokenize", self.first_prefill)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics.aiohttp_handler)
        app.router.add_post("/debug/route", self.preview)
        app.router.add_get("/debug/residence", self.residence)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
                                             auto_decompress=False)

    async def _close(self, app) -> None:
        if self.session is not None:
            await self.session.close()

    def _client(self) -> aiohttp.ClientSession:
        """The HTTP client to the prefills (made when the app starts, ``_open``)."""
        if self.session is None:
            raise RuntimeError("the router's HTTP client is made when its app starts")
        return self.session

    async def health(self, request: web.Request) -> web.Response:
        health = {"status": "ok", "role": "router", "in_flight": self.in_flight,
                  "in_flight_grpc": self.relays.in_flight["grpc"],
                  "queued": self.gate.waiting() if self.gate is not None else 0,
                  "draining": self.is_draining(), "prefills": self.router.state()}
        if self.tokenizer_source is not None:
            health["tokenizer"] = self.tokenizer_source.state()
        return web.json_response(health)

    async def ready(self, request: web.Request) -> web.Response:
        if self.is_draining():
            return web.json_response({"ready": False, "reason": "draining"}, status=503)
        if self.router.tokenizer is None:
            reason = self.tokenizer_source.why_not() if self.tokenizer_source is not None else "no tokenizer"
            return web.json_response({"ready": False, "reason": f"no tokenizer yet: {reason}"}, status=503)
        if self.router.prefills.routable():
            return web.json_response({"ready": True})
        return web.json_response({"ready": False, "reason": "no routable prefill"}, status=503)

    async def first_prefill(self, request: web.Request) -> web.StreamResponse:
        """The request relayed to the first routable prefill as it came (its path, body), its answer back."""
        routable = self.router.prefills.routable()
        if not routable:
            return _error(503, "no prefill is routable", "no_prefill_available")
        body = await request.read() if request.can_read_body else None
        headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
        if body is not None:
            headers["Content-Type"] = "application/json"
        async with self._client().request(request.method, routable[0].http_url + request.path, data=body,
                                        headers=headers) as up:
            return web.Response(body=await up.read(), status=up.status, headers=_headers(up))

    async def preview(self, request: web.Request) -> web.Response:
        """What the router would do with this body now (no relay, no metrics): for operators and tests."""
        kind = request.query.get("kind", "chat")
        if kind not in ("chat", "completion"):
            return web.json_response({"error": f"kind must be chat or completion, got {kind!r}"}, status=400)
        ids = prompt_token_ids(await request.read(), kind, self.router.tokenizer)
        choice = self.router.decide(ids, preview=True)
        if choice is None:
            return _error(503, "no prefill is routable", "no_prefill_available")
        return web.json_response({"prefill": choice.address, "reason": choice.reason,
                                  "cached_blocks": choice.overlap_blocks,
                                  "ranking": list(choice.ranking), "prompt_tokens": len(ids) if ids else None})

    async def residence(self, request: web.Request) -> web.Response:
        """The router's own time of the requests recorded after ``since`` (``residence.py``)."""
        try:
            since = int(request.query.get("since", "0"))
        except ValueError:
            return web.json_response({"error": f"since must be an integer, got {request.query['since']!r}"},
                                     status=400)
        return web.json_response(self.residences.since(since))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._relay(request, "completion")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._relay(request, "chat")

    async def _relay(self, request: web.Request, kind: str) -> web.StreamResponse:
        clock = Clock(request.headers.get(REQUEST_ID_HEADER))
        body = await request.read()
        clock.body = time.perf_counter()
        ids = prompt_token_ids(body, kind, self.router.tokenizer)
        if self.gate is None:
            return await self._relay_to(request, body, ids, None, clock)
        start = time.perf_counter()
        try:
            cls, max_tokens = request_class(self.gate.classes, body, request.headers.get(SLO_HEADER))
        except ValueError as exc:
            self.metrics.requests.labels(outcome="error", reason="bad_request").inc()
            return _error(400, str(exc), "unknown_slo_class", "invalid_request_error")
        timeout_s = deadline_s(request.headers.get(REQUEST_TIMEOUT_HEADER), self.request_timeout_s)
        try:
            async with self.gate.admission(f"router-{uuid.uuid4().hex}", cls, len(ids or ()), max_tokens,
                                           timeout_s) as passage:
                return await self._relay_to(request, body, ids, passage, clock)
        except Rejected as exc:
            self.metrics.requests.labels(outcome="error", reason="slo_rejected").inc()
            resp = _error(429, str(exc), "slo_cannot_be_met", "rate_limit_error")
            resp.headers["Retry-After"] = str(exc.retry_after_s)
            return resp
        except GateTimeout as exc:
            self.metrics.requests.labels(outcome="error", reason="timeout").inc()
            self.metrics.e2e_latency.observe(time.perf_counter() - start)
            return _error(504, str(exc), "request_timeout", "timeout_error")

    async def _relay_to(self, request: web.Request, body: bytes, ids: list[int] | None, passage,
                        clock: Clock) -> web.StreamResponse:
        """The request through the prefills (``relay.py``: rank -> try prefill -> stream / retry / resume / give up)."""
        timeout_s = deadline_s(request.headers.get(REQUEST_TIMEOUT_HEADER), self.request_timeout_s)
        relay = self.relays.open("http", ids, timeout_s, passage)
        if not await relay.rank():
            return _error(503, "no prefill is routable", "no_prefill_available")
        clock.decided = time.perf_counter()
        forwarded = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
        with relay:
            while (attempt := await relay.next_attempt()) is not None:
                resp = await self._attempt(request, body, relay, attempt, forwarded, clock)
                if resp is not None:
                    return resp
            return _gave_up(relay)

    async def _attempt(self, request: web.Request, body: bytes, relay, attempt, forwarded: dict[str, str],
                       clock: Clock):
        """One prefill: the client's response, or None when nothing of it reached the client (the next is tried)."""
        with attempt:
            sent = TimedBody(body)  # notes when the body was written (the router's residence: residence.py)
            try:
                upstream = await self._client().post(attempt.watch.http_url + request.path, data=sent, headers={
                    "Content-Type": "application/json", **forwarded, RESUMABLE_HEADER: "1"})
            except aiohttp.ClientConnectionError as exc:
                log.warning("prefill %s unreachable (%s); trying the next one", attempt.address, exc)
                return None
            if upstream.status == 503:
                early = await upstream.read()  # a short JSON error: nothing of the request was computed
                if _error_code(early) == "no_decode_available":
                    # its decodes left before it did (a protocol rollout): another prefill may take it
                    log.info("prefill %s has no decode for the request; trying another", attempt.address)
                    upstream.release()
                    attempt.refused((upstream, early))
                    return None
            client = _ClientResponse(request, upstream, relay, self.residences, clock, sent)
            try:
                attempt.count()
                if is_sse(upstream):
                    await pipe(upstream, client.events, client.write)
                else:  # read whole: a prefill that breaks before its end is retried (nothing went out)
                    data = await upstream.read()
                    client.events.read_at = time.perf_counter()
                    if data:
                        await client.write(data)
                return await client.end()
            except (aiohttp.ClientError, StreamCut) as exc:  # the prefill went away mid-response
                log.warning("prefill %s failed mid-response: %s", attempt.address, exc)
                attempt.broke()
                broke = exc
            finally:
                if upstream.content.at_eof():
                    upstream.release()  # keep the connection for the next request
                else:
                    upstream.close()  # the prefill sees the client leave and cancels
        if client.resp is None:  # nothing reached the client: the whole request goes to the next prefill
            return None
        await self._after_break(relay, request, client, client.resp, body, forwarded,
                                f"prefill {attempt.address} failed mid-response: {type(broke).__name__}")
        return client.resp

    async def _after_break(self, relay, request, client: _ClientResponse, resp: web.StreamResponse, body: bytes,
                           forwarded: dict[str, str], message: str) -> None:
        """The client has part of a stream (``resp``, begun) whose prefill broke: resume it (``resume.py``), or
        end it with an error event and [DONE] (never a stream that just stops)."""
        events = client.events
        resumable = events.can_resume
        why_not = "the stream cannot be resumed" if not resumable else await resume(
            relay, self._client(), request.path, body, events, client.write, forwarded)
        relay.resumed(why_not, resumable)
        if why_not is not None:
            log.warning("%s; not resumed: %s", message, why_not)
            if not events.error_sent:  # as the prefill ends its own stream on an error
                event = {"error": {"message": f"{message}; not resumed: {why_not}", "type": "server_error",
                                   "param": None, "code": "prefill_failed"}}
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())
            await resp.write(DONE)
        await resp.write_eof()


class _ClientResponse:
    """The client's response to a relayed request: it starts with the first whole event (or the whole body)
    under the status and headers of the prefill that sent it; each write feeds the SLO queue's estimator."""

    def __init__(self, request: web.Request, upstream, relay, residences: Residences, clock: Clock, sent: TimedBody):
        self.request, self.upstream, self.relay = request, upstream, relay
        self.residences, self.clock, self.sent = residences, clock, sent
        self.counter = TokenCounter(upstream.headers.get("Content-Type", ""), relay.passage)
        self.events = EventRelay()
        self.resp: web.StreamResponse | None = None

    async def write(self, data: bytes) -> None:
        resp, first = self.resp, self.resp is None
        if resp is None:  # headers go out with the first whole event
            self.relay.replied()
            resp = self.resp = web.StreamResponse(status=self.upstream.status, headers=_headers(self.upstream))
            await resp.prepare(self.request)
        self.counter.feed(data)
        await resp.write(data)
        if first:
            self._first_written()

    def _first_written(self) -> None:
        """The first of the answer is on the client's connection: the request's residence (``residence.py``)."""
        self.clock.sent, self.clock.read = self.sent.written_at, self.events.read_at
        self.residences.record(self.clock, time.perf_counter())

    async def end(self) -> web.StreamResponse:
        """The prefill's whole answer went out: end the response and the request."""
        status = self.upstream.status
        if self.resp is None:
            self.resp = web.Response(status=status, headers=_headers(self.upstream))
            await self.resp.prepare(self.request)
            await self.resp.write_eof()
            self._first_written()
        else:
            await self.resp.write_eof()
        self.counter.done()
        self.relay.finish("ok" if status < 400 else "error", "relayed" if status < 400 else f"http_{status}")
        return self.resp


def _gave_up(relay) -> web.Response:
    """No prefill took the request: the last refusing prefill's own answer, else why."""
    if relay.refusal is not None:  # the last prefill's own answer, as it gave it
        relay.finish("error", "http_503")
        upstream, early = relay.refusal
        return web.Response(status=503, body=early, headers=_headers(upstream))
    failed = bool(relay.failed)
    relay.finish("error", "prefill_failed" if failed else "prefill_unreachable")
    return _error(503 if not failed else 502,
                  f"no prefill could {'serve' if failed else 'be reached'} (tried {relay.tried_text()})",
                  "prefill_failed" if failed else "no_prefill_available")


def _error_code(body: bytes) -> str | None:
    """The ``error.code`` of an OpenAI error body, or None."""
    try:
        return (json.loads(body).get("error") or {}).get("code")
    except (ValueError, AttributeError):
        return None


def _headers(upstream) -> dict[str, str]:
    return {h: upstream.headers[h] for h in RELAYED_HEADERS if h in upstream.headers}
