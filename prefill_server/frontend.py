"""Frontend: what the HTTP and gRPC APIs share between parsing a request and the PrefillNode.

- ``prompt_ids(parsed)``: tokenize (chat template for chat requests);
- ``sampling(spec, n_prompt)``: the engine's SamplingParams, with the default max_tokens
  capped by the context left, and a ``BadRequest`` when the prompt (plus max_tokens)
  does not fit the model's context;
- ``stream(...)``: the PrefillNode's token deltas as ``Piece``s, one per generated token
  (its id and the text it releases, "" when held back: part of a UTF-8 character or a
  possible stop string), then a last finished Piece with no token that carries the text
  still held back; stop strings cut; records the request's metrics (TTFT, TBT, e2e,
  outcome) exactly once; the first Piece carries the prompt tokens a prefix cache held
  (``cached_tokens``, the first attempt's); ``stream(..., produced=...)`` goes on with a
  stream another prefill began (``pdserve.stream_resume``): its text state as the whole
  stream's (``text_stream``);
- the end-to-end deadline: ``request_timeout_s`` (``--request-timeout``), shortened per
  request by ``stream(..., timeout_s=...)`` (the client's ``X-Request-Timeout`` header or
  gRPC deadline). When it passes, the node's generator is cancelled (its Session to decode
  is cancelled and everything it holds is released) and ``RequestTimedOut`` is raised:
  HTTP 504 / an SSE error event, gRPC DEADLINE_EXCEEDED. A request still waiting in the
  node's admission queue gives up just before the deadline, and its message says so;
- SLO classes (``slo``, a ``pdserve.slo.GlobalQueue``): ``slo_class(header, priority)``
  picks the request's class (``BadRequest`` naming the known ones); ``stream`` tells the
  queue of its arrival (``Rejected``: early rejection, HTTP 429), its tokens and its end.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve import defaults
from pdserve.chat_prompt import chat_prompt
from pdserve.engine.grammar import GrammarSpec, Grammars
from pdserve.slo import HEADER as SLO_HEADER
from pdserve.slo import Rejected
from pdserve.stream_resume import RESUME_FIELD

from .admission_queue import deadline_message, waited_in_line
from .closing import aclose_fully
from .decode_session import DecodeFailed, Delta, decode_reservation
from .node import NoDecodeAvailable, PrefillNode, QueueFull, QueueTimeout, RequestTooLarge
from .openai_api import DEFAULT_CHAT_MAX_TOKENS, DEFAULT_COMPLETION_MAX_TOKENS, BadRequest, ParsedRequest, SamplingSpec
from .text_stream import TextStream

if TYPE_CHECKING:
    from pdserve.engine import SamplingParams
    from pdserve.metrics import ServerMetrics
    from pdserve.slo import GlobalQueue, SloClass, SloRequest


DEFAULT_REQUEST_TIMEOUT_S = defaults.REQUEST_TIMEOUT_S


class RequestTimedOut(Exception):
    """The request's end-to-end deadline passed; everything it held has been released."""


def parse_timeout_header(value: str | None, name: str = "X-Request-Timeout") -> float | None:
    """Seconds from a client's timeout header (None when absent); BadRequest naming the header."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        raise BadRequest(f"header {name} must be a number of seconds, got {value[:40]!r}", name) from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise BadRequest(f"header {name} must be a positive finite number of seconds, got {value[:40]!r}", name)
    return seconds


@dataclass(slots=True)
class Piece:
    """What ``Frontend.stream`` yields: one generated token and the text it releases (often ""
    while a character or a possible stop string is incomplete), or, last, the finish: no
    token, ``finished`` set, and the text still held back at the end (usually "")."""

    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list | None = None  # the token's TokenLogprob (pdserve.engine.logprobs) when the request asked
    prompt_logprobs: list | None = None  # on the first Piece, when the sampling asked prompt_logprobs (engine shape)
    cached_tokens: int | None = None  # on the first Piece: the prompt tokens a prefix cache held (usage)


class Frontend:
    def __init__(self, node: PrefillNode, tokenizer, sampling_cls: type[SamplingParams], model_name: str,
                 max_model_len: int, metrics: ServerMetrics | None = None, vocab_size: int | None = None,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, slo: GlobalQueue | None = None):
        if not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
        self.node, self.tokenizer, self.sampling_cls, self.vocab_size = node, tokenizer, sampling_cls, vocab_size
        self.request_timeout_s = request_timeout_s
        self.model_name, self.max_model_len, self.metrics = model_name, max_model_len, metrics
        self.in_flight = 0
        self.active: set[str] = set()  # request ids in flight (client-given ids must be unique)
        self.slo = slo  # the SLO classes and the global queue (pdserve.slo)
        self._grammars: Grammars | None = None  # compiles response_format schemas (validation), on first use

    def slo_class(self, header: str | None, priority=None) -> SloClass | None:
        """The request's SLO class from the X-SLO-Class header / body priority; BadRequest naming the known ones."""
        if self.slo is None:
            return None
        try:
            return self.slo.classes.select(header, priority)
        except ValueError as exc:
            raise BadRequest(str(exc), "priority" if header is None else SLO_HEADER, "unknown_slo_class") from None

    def prompt_ids(self, parsed: ParsedRequest) -> list[int]:
        """The (first) prompt's token ids."""
        return self.prompt_ids_list(parsed)[0]

    def prompt_ids_list(self, parsed: ParsedRequest) -> list[list[int]]:
        """Every prompt's token ids: the chat template's, or each of /v1/completions' prompts."""
        if parsed.kind == "chat":  # the rule the router hashes prompts by too (pdserve.chat_prompt)
            return [self.tokenizer.encode(chat_prompt(self.tokenizer, parsed.messages or [], parsed.tools))]
        return [list(p) if isinstance(p, list) else self.tokenizer.encode(p) for p in parsed.prompts]

    def echo_texts(self, parsed: ParsedRequest, prompts: list[list[int]]) -> list[str]:
        """Per prompt, the text ``echo`` puts before each choice's text ("" without echo)."""
        if not parsed.echo:
            return [""] * len(prompts)
        return [p if isinstance(p, str) else self.tokenizer.decode(ids) for p, ids in zip(parsed.prompts, prompts)]

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise BadRequest("the prompt is empty after tokenization", "prompt")
        if self.vocab_size is not None:
            bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise BadRequest(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})", "prompt")

    def sampling(self, spec: SamplingSpec, n_prompt: int, kind: str = "completion", prompt_logprobs: int | None = None):
        """``prompt_logprobs``: also the prompt's logprobs (echo with logprobs). ``max_tokens`` 0 (echo only:
        the API shows none of the output) runs one token."""
        room = self.max_model_len - n_prompt
        if room < 1:
            raise BadRequest(
                f"prompt has {n_prompt} tokens but the model's context length is {self.max_model_len} "
                f"(prompt plus at least one generated token must fit)", "prompt", "context_length_exceeded")
        grammar = self.grammar(spec)
        max_tokens = spec.max_tokens
        if max_tokens == 0:
            max_tokens = 1
        elif max_tokens is None:
            max_tokens = min(room, DEFAULT_CHAT_MAX_TOKENS if kind == "chat" else DEFAULT_COMPLETION_MAX_TOKENS)
        elif n_prompt + max_tokens > self.max_model_len:
            raise BadRequest(
                f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds the model's context length "
                f"of {self.max_model_len}", "max_tokens", "context_length_exceeded")
        try:
            return self.sampling_cls(
                max_tokens=max_tokens, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
                seed=spec.seed, stop=list(spec.stop), stop_token_ids=list(spec.stop_token_ids),
                ignore_eos=spec.ignore_eos, logprobs=spec.logprobs, grammar=grammar, prompt_logprobs=prompt_logprobs,
            )
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    def grammar(self, spec: SamplingSpec) -> GrammarSpec | None:
        """The request's response_format as the engine's GrammarSpec, compiled once here so a schema
        the grammar library refuses is a BadRequest naming response_format (not a decode failure)."""
        rf = spec.response_format
        if rf is None:
            return None
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.vocab_size or self.tokenizer.vocab_size)
        grammar = GrammarSpec(rf.kind, rf.schema)
        try:
            self._grammars.check(grammar)
        except ValueError as exc:
            raise BadRequest(f"response_format: {exc}", "response_format") from None
        return grammar

    def text_stream(self, stop: list[str], produced: list[int] | tuple = ()) -> TextStream:
        """The request's TextStream, past ``produced`` (tokens a resumed stream already sent: its state
        is what the stream's own had, text held back included; ``stopped`` when their last one completed a
        stop string). BadRequest when a stop string ends their text before their last token."""
        text = TextStream(self.tokenizer.detokenizer(), stop, self.tokenizer.decode)
        for k, token_id in enumerate(produced):
            if text.stopped:
                raise BadRequest(f"{RESUME_FIELD}.token_ids: a stop string ends their text at token {k - 1}, before "
                                 f"their end (the stream ended there)", f"{RESUME_FIELD}.token_ids")
            text.add([token_id])
        return text

    async def stream(self, request_id: str, prompt_ids: list[int], sp: SamplingParams, timeout_s: float | None = None,
                     slo_class: SloClass | None = None, produced: list[int] | tuple = ()):
        """Pieces until the finished one. Raises NoDecodeAvailable / DecodeFailed from the node,
        RequestTimedOut once min(request_timeout_s, timeout_s) seconds have passed, Rejected
        (pdserve.slo) at once when the class's early rejection says its SLO cannot be met.
        ``produced``: a resumed stream's tokens the client has (at most ``sp.max_tokens``; that many:
        only the finish comes): Pieces of the tokens after them, text as the whole stream's."""
        if request_id in self.active:
            raise BadRequest(f"request_id {request_id!r} is already in flight", "request_id")
        text = self.text_stream(sp.stop, produced)
        slo = self._arrive(request_id, slo_class, prompt_ids, sp)
        limit = self.request_timeout_s if timeout_s is None else min(timeout_s, self.request_timeout_s)
        deadline = time.monotonic() + limit
        self.active.add(request_id)
        clock = self.metrics.request_clock(len(prompt_ids)) if self.metrics else None
        outcome, reason = "error", "error"
        self.in_flight += 1
        if text.stopped or len(produced) >= sp.max_tokens:  # a resumed stream whose last token went out, not its finish
            deltas = _finished("stop" if text.stopped else "length")
        else:
            deltas = self.node.generate(request_id, prompt_ids, sp, deadline=deadline, slo=slo, produced=produced)
        cached: int | None = None  # the first attempt's prefix hit, told with the first Piece (``due``)
        due = False
        try:
            while (delta := await self._next_delta(deltas, request_id, deadline, limit)) is not None:
                if cached is None and delta.cached_tokens is not None:
                    cached, due = delta.cached_tokens, True
                if delta.token_ids:
                    if clock is not None:
                        clock.token(len(delta.token_ids))
                    if slo is not None and self.slo is not None:
                        self.slo.token(slo, len(delta.token_ids))
                for piece in _token_pieces(delta, text):
                    if due:
                        piece.cached_tokens, due = cached, False
                    yield piece
                if delta.finished or text.stopped:
                    rest = "" if text.stopped else text.flush()
                    outcome, reason = "ok", "stop" if text.stopped else delta.finish_reason or "stop"
                    if clock is not None:  # the request is served now, whatever the teardown takes
                        clock.finish(outcome, reason)
                    if slo is not None and self.slo is not None:
                        self.slo.finish(slo, outcome)
                    # the Delta's prompt logprobs went on its first token's Piece, if it had one
                    prompt_lps = None if delta.token_ids else delta.prompt_logprobs
                    yield Piece([], rest, True, reason, prompt_logprobs=prompt_lps,
                                cached_tokens=cached if due else None)
                    return
            raise DecodeFailed("the request ended without a finish")
        except (NoDecodeAvailable, DecodeFailed, RequestTimedOut) as exc:
            reason = _failure_reason(exc)
            raise
        except (asyncio.CancelledError, GeneratorExit, ConnectionError):
            if outcome != "ok":  # closing the stream after its finished piece is no cancellation
                outcome, reason = "cancelled", "client_disconnected"
            raise
        finally:
            await aclose_fully(deltas)  # closes the Session (cancel reaches decode) if still open
            self.in_flight -= 1
            self.active.discard(request_id)
            if clock is not None:
                clock.finish(outcome, reason)
            if slo is not None and self.slo is not None:  # leaves the queue (if it waits) at once
                self.slo.finish(slo, outcome)

    def _arrive(self, request_id: str, slo_class: SloClass | None, prompt_ids: list[int],
                sp: SamplingParams) -> SloRequest | None:
        """The request's arrival in the SLO queue (None without SLO classes); Rejected, counted, when its
        class's early rejection says its SLO cannot be met."""
        if self.slo is None:
            return None
        try:
            cls = slo_class or self.slo.classes.default
            # the leading tokens our prefix cache holds are not computed again, so its prefill estimate counts
            # the rest; looked up (hashing the prompt: milliseconds for a long one) only where an estimate decides
            cached = 0
            if self.slo.policy == "qlm" or cls.early_reject:
                cached = self.node.disaggregator.held_blocks(prompt_ids) * self.node.block_size
            return self.slo.arrive(request_id, cls, len(prompt_ids), sp.max_tokens,
                                   decode_reservation(len(prompt_ids), sp.max_tokens, self.node.block_size),
                                   cached_tokens=cached)
        except Rejected:
            if self.metrics is not None:
                self.metrics.requests.labels(outcome="error", reason="slo_rejected").inc()
            raise

    async def _next_delta(self, deltas, request_id: str, deadline: float, limit: float) -> Delta | None:
        """The node's next Delta (None: its Deltas ended), or RequestTimedOut saying why the deadline came."""
        try:
            # the timeout cancels the node's generator at the deadline and waits for its
            # clean-up (Session cancelled, blocks and CacheStore entry released); not
            # wait_for, which on Python 3.11 drops a client's cancel that comes in the same
            # turn as a token (the stream then ran on after the client had gone)
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                return await deltas.__anext__()
        except StopAsyncIteration:
            return None
        except QueueTimeout as exc:  # the admission queue gave up just before the deadline, saying why
            raise RequestTimedOut(str(exc)) from None
        except asyncio.TimeoutError as exc:
            waited = waited_in_line(exc)
            if waited is not None:  # the deadline came while it waited in line (the queue's own timer lost the race)
                raise RequestTimedOut(deadline_message(request_id, waited)) from None
            raise RequestTimedOut(f"request {request_id} did not finish within its deadline of {limit:g}s "
                                  f"(--request-timeout, or the client's X-Request-Timeout / gRPC deadline)") from None


def _token_pieces(delta: Delta, text: TextStream) -> list[Piece]:
    """One Piece per token of ``delta``, its text possibly "" (the Delta's prompt logprobs on the first);
    none after a token that completes a stop string (the engine stops on its next step, or already did:
    tokens after it are not the client's)."""
    pieces = []
    lps = delta.logprobs or ()
    for k, token_id in enumerate(delta.token_ids):
        pieces.append(Piece([token_id], text.add([token_id]), logprobs=list(lps[k:k + 1]) or None,
                            prompt_logprobs=delta.prompt_logprobs if k == 0 else None))
        if text.stopped:
            break
    return pieces


def _failure_reason(exc: Exception) -> str:
    """The requests metric's reason for a request that ended with ``exc``."""
    if isinstance(exc, QueueFull):
        return "queue_full"
    if isinstance(exc, RequestTooLarge):
        return "too_large"
    if isinstance(exc, NoDecodeAvailable):
        return "no_decode"
    return "decode_failed" if isinstance(exc, DecodeFailed) else "timeout"


async def _finished(reason: str):
    """The node's Deltas of a request that has nothing left to generate: its finish only."""
    yield Delta([], True, reason)
