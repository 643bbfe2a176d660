"""An OpenAI request's choices as a whole response or as Server-Sent Events (``http_api.py``
routes here once the first ``(index, Piece)`` of ``choices.merged`` arrived).

``ChoiceState`` follows one choice: its text (after the echoed prompt, with ``echo``), the
tokens it produced, its finish reason and its logprobs (``openai_logprobs.py``).

Streaming, per choice as for a single one (see http_api.py): one event per generated token
(its text possibly ""), the echoed prompt in that choice's first event, the first chat event
with ``role``; then one event with its ``finish_reason``; events of different choices
interleave as their tokens come. After every choice finished: the usage event (with
``stream_options.include_usage``) and ``[DONE]``. The usage's ``prompt_tokens_details.cached_tokens``
counts the prompt tokens a prefix cache held, per prompt as its first choice found it
(``cached_tokens``).

Echo with logprobs (/v1/completions): the prompt's tokens lead each choice's logprobs (the first
with null logprob), computed by the prompt's first choice (``PromptEcho`` holds them for its
siblings) and sent with the choice's first event. ``max_tokens: 0`` with echo (``echo_only``)
runs one token and shows none of it: the echoed prompt (and its logprobs), finish "length".

Resumed streams (``resume.py``; the contract: ``pdserve.stream_resume``): a stream the router can
resume carries each event's token ids; a resumed one's choice starts as the interrupted stream
left it (its text, tokens and role sent: ``ChoiceState.resume_after``), so its events are the ones
the interrupted stream would have sent next, and its usage counts both parts.

Tools (chat with ``tools`` and a ``tool_choice`` other than "none", ``openai_tools.py``): a
choice's text is parsed for tool calls once it is whole, so its stream holds the tokens back
and sends, at its end, one event with the ``role`` and either the ``content`` or the
``tool_calls`` (with the logprobs of all its tokens), then the finish event ("tool_calls" when
there are calls).
"""

from __future__ import annotations

import logging

from aiohttp import web

from . import openai_api as oa
from .choices import merged, plan
from .decode_session import DecodeFailed
from .frontend import Piece, RequestTimedOut
from .node import NoDecodeAvailable
from .openai_logprobs import LogprobsFormatter
from .openai_tools import parse_tool_calls
from .resume import Resume, tag

log = logging.getLogger(__name__)


class PromptEcho:
    """One prompt's echo (/v1/completions ``echo``), shared by that prompt's choices: its text, its
    token ids and, with logprobs, its prompt logprobs (from the piece that first carries them)."""

    def __init__(self, text: str, ids: list[int], tokenizer):
        self.text, self.ids, self.tokenizer = text, ids, tokenizer
        self.logprobs: list | None = None
        self._offsets: list[int] | None = None

    def offsets(self) -> list[int]:
        """Where each prompt token's text starts in the echoed text (as the tokenizer decodes it)."""
        if self._offsets is None:
            detok, self._offsets = self.tokenizer.detokenizer(), []
            for token_id in self.ids:
                self._offsets.append(min(len(detok.text), len(self.text)))
                detok.add([token_id])
        return self._offsets


class ChoiceState:
    def __init__(self, parsed: oa.ParsedRequest, index: int, tokenizer, echo: PromptEcho | None = None,
                 prompt_index: int = 0):
        self.parsed, self.index, self.prompt_index = parsed, index, prompt_index
        self.cached_tokens = 0  # the prompt tokens a prefix cache held for this choice (its first Piece says)
        text = echo.text if echo is not None else ""
        self.echo = echo
        self.parts: list[str] = [text] if text else []
        self.chars = len(text)  # characters of text so far (completion logprobs' text_offset)
        self.pending_echo = text  # goes out with the first streamed event
        self.echo_only = echo is not None and parsed.sampling.max_tokens == 0  # show the prompt, not the token run
        self.tokens = 0
        self.finish_reason: str | None = None
        self.started = False  # a streamed event was sent (chat: the role went out)
        top = parsed.sampling.logprobs
        self.logprobs = None if top is None else LogprobsFormatter(parsed.kind, tokenizer, top)
        self.prompt_logprobs_due = echo is not None and self.logprobs is not None  # the prompt's lead the logprobs
        self.tools = parsed.kind == "chat" and bool(parsed.tools) and parsed.tool_choice != "none"
        self.finish_sent = False  # a resumed stream whose finish event went out before (only its end is left)

    def resume_after(self, text: str, tokens: int, finish_reason: str | None = None) -> None:
        """A stream resumed after ``tokens`` tokens that sent ``text`` (``resume.py``): as if it had sent them."""
        self.parts, self.chars, self.tokens = [text], len(text), tokens
        self.started = tokens > 0  # chat: the role went out with the first token
        self.finish_sent = finish_reason is not None

    def add(self, piece) -> tuple[str, dict | None]:
        """The piece's text (the echoed prompt before the first one) and its logprobs object (the prompt's
        first, with echo); an echo_only choice shows none of the generated token."""
        if piece.cached_tokens is not None:
            self.cached_tokens = piece.cached_tokens
        if piece.prompt_logprobs is not None and self.echo is not None:
            self.echo.logprobs = piece.prompt_logprobs  # for this choice and its siblings (choices.py)
        token_ids, piece_text, piece_lps = ([], "", None) if self.echo_only else (piece.token_ids, piece.text,
                                                                                  piece.logprobs)
        lps = None
        if self.logprobs is not None:
            start = self.logprobs.size()
            echo = self.echo
            if self.prompt_logprobs_due and echo is not None and echo.logprobs is not None:
                self.logprobs.add_prompt(echo.ids, echo.logprobs, echo.offsets())
                self.prompt_logprobs_due = False
            if token_ids:
                self.logprobs.add(list(piece_lps or ()), [self.chars] * len(token_ids))
            if self.logprobs.size() > start:
                lps = self.logprobs.since(start)
        text = self.pending_echo + piece_text
        self.pending_echo = ""
        self.parts.append(piece_text)
        self.chars += len(piece_text)
        self.tokens += len(token_ids)
        if piece.finished:
            self.finish_reason = "length" if self.echo_only else piece.finish_reason or "stop"
        return text, lps

    def calls(self) -> tuple[str | None, list[dict], str]:
        """(content, tool calls, finish reason) of the whole choice."""
        text, reason = "".join(self.parts), self.finish_reason or "stop"
        if not self.tools:
            return text, [], reason
        content, calls = parse_tool_calls(text, self.parsed.tools, self.parsed.tool_choice)
        return content, calls, "tool_calls" if calls and reason == "stop" else reason

    def choice(self) -> dict:
        whole = None if self.logprobs is None else self.logprobs.whole()
        content, calls, reason = self.calls()
        out = oa.choice(self.parsed, self.index, content, reason, whole)
        if calls:
            out["message"]["tool_calls"] = calls
        return out

    def last_chunks(self) -> list[dict]:
        """Tools: the held-back choice as its two last stream events (content or calls, then the finish)."""
        content, calls, reason = self.calls()
        whole = None if self.logprobs is None else self.logprobs.whole()
        body = oa.chunk(self.parsed, content, None, first=True, index=self.index, logprobs=whole)
        if calls:
            body["choices"][0]["delta"]["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
        return [body, oa.chunk(self.parsed, None, reason, index=self.index)]


def cached_tokens(states: list[ChoiceState]) -> int:
    """The usage's ``prompt_tokens_details.cached_tokens``: per prompt, as its first choice found the prefix cache
    (``prompt_tokens`` counts each prompt once, however many choices it has)."""
    first: dict[int, ChoiceState] = {}
    for s in sorted(states, key=lambda s: s.index):
        first.setdefault(s.prompt_index, s)
    return sum(s.cached_tokens for s in first.values())


def _error(status: int, message: str, type_: str, code: str) -> web.Response:
    return web.json_response(oa.error_body(message, type_, None, code), status=status)


def start(fe, parsed: oa.ParsedRequest, slo_class, timeout_s: float | None, resume: Resume | None = None):
    """A parsed request's choices under way: (prompt tokens in all, ChoiceStates, the merged
    ``(index, Piece)`` stream). Raises BadRequest for a prompt the engine cannot take (nothing
    has started then). Both the HTTP API and the Batch API's lines start requests here.
    ``resume``: the one choice goes on after the tokens its client has (``resume.py``), under the
    stream's id and created; with its finish sent, only the end of the stream is left."""
    if resume is not None:
        parsed.response_id, parsed.created = resume.id, resume.created
    prompts = fe.prompt_ids_list(parsed)
    # echo with logprobs: the prompt's own logprobs (the same top alternatives per token)
    prompt_logprobs = parsed.sampling.logprobs if parsed.echo else None
    samplings = []
    for ids in prompts:
        fe.check_prompt(ids)
        samplings.append(fe.sampling(parsed.sampling, len(ids), parsed.kind, prompt_logprobs=prompt_logprobs))
    echoes = [PromptEcho(text, ids, fe.tokenizer) for text, ids in zip(fe.echo_texts(parsed, prompts), prompts)]
    choices = plan(parsed.request_id, prompts, samplings, parsed.n)
    states = [ChoiceState(parsed, c.index, fe.tokenizer, echoes[c.prompt_index] if parsed.echo else None,
                          c.prompt_index) for c in choices]
    produced: list[int] | tuple = ()
    if resume is not None:
        resume.check(samplings[0])
        produced = resume.token_ids
        states[0].resume_after(fe.text_stream(samplings[0].stop, produced).text, len(produced), resume.finish_reason)
        if resume.finish_reason is not None:
            return sum(len(ids) for ids in prompts), states, _finish_sent(resume.finish_reason)
    pieces = merged(choices, lambda c: fe.stream(c.request_id, c.prompt_ids, c.sampling, timeout_s, slo_class,
                                                 produced=produced))
    return sum(len(ids) for ids in prompts), states, pieces


async def _finish_sent(reason: str):
    """The ``(index, Piece)`` stream of a resumed choice whose finish went out already."""
    yield 0, Piece([], "", True, reason)


async def whole(parsed, states: list[ChoiceState], n_prompt: int, first, pieces) -> tuple[int, dict]:
    """Every choice to its end: (HTTP status, the response body or an OpenAI error body)."""
    event = first
    try:
        while True:
            index, piece = event
            states[index].add(piece)
            if all(s.finish_reason for s in states):
                break
            event = await pieces.__anext__()
    except (DecodeFailed, NoDecodeAvailable) as exc:
        return 502, oa.error_body(str(exc), "server_error", None, "decode_failed")
    except RequestTimedOut as exc:
        return 504, oa.error_body(str(exc), "timeout_error", None, "request_timeout")
    n_tokens = sum(s.tokens for s in states)
    return 200, oa.response(parsed, [s.choice() for s in states], n_prompt, n_tokens, cached_tokens(states))


async def collect(parsed, states: list[ChoiceState], n_prompt: int, first, pieces) -> web.Response:
    status, body = await whole(parsed, states, n_prompt, first, pieces)
    return web.json_response(body, status=status)


async def sse(request: web.Request, parsed, states: list[ChoiceState], n_prompt: int, first, pieces,
              resumable: bool = False) -> web.StreamResponse:
    """``resumable``: each event carries its token ids for the router (``resume.tag``)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)

    def event_bytes(payload: dict, token_ids=(), **more) -> bytes:
        return oa.sse(tag(payload, token_ids, **more) if resumable else payload)

    event = first
    try:
        while True:
            index, piece = event
            state = states[index]
            is_first = not state.started
            state.started = True
            text, lps = state.add(piece)
            if state.tools:  # parsed for tool calls once whole: sent at its end
                if piece.finished:
                    for payload in state.last_chunks():
                        await resp.write(oa.sse(payload))
            elif piece.finished:  # no token: the finish reason and any text held back to the end
                shown = text if text or parsed.kind == "completion" else None
                if not state.finish_sent:
                    await resp.write(event_bytes(oa.chunk(parsed, shown, state.finish_reason, first=is_first,
                                                          index=index, logprobs=lps),
                                                 finish_reason=state.finish_reason))
            elif state.echo_only:  # the generated token is not shown: only the echoed prompt, once
                if text or lps:
                    await resp.write(oa.sse(oa.chunk(parsed, text, None, first=is_first, index=index, logprobs=lps)))
            else:  # one event per generated token, also when its text is "" (held back)
                await resp.write(event_bytes(oa.chunk(parsed, text, None, first=is_first, index=index, logprobs=lps),
                                             piece.token_ids))
            if piece.finished and all(s.finish_reason for s in states):
                if parsed.include_usage:
                    await resp.write(event_bytes(oa.usage_chunk(parsed, n_prompt, sum(s.tokens for s in states),
                                                                 cached_tokens(states)), usage=True))
                break
            event = await pieces.__anext__()
    except (DecodeFailed, NoDecodeAvailable) as exc:
        log.warning("request %s: %s", parsed.request_id, exc)
        await resp.write(oa.sse(oa.error_body(str(exc), "server_error", code="decode_failed")))
    except RequestTimedOut as exc:
        log.warning("request %s: %s", parsed.request_id, exc)
        await resp.write(oa.sse(oa.error_body(str(exc), "timeout_error", code="request_timeout")))
    await resp.write(oa.sse("[DONE]"))
    await resp.write_eof()
    return resp
