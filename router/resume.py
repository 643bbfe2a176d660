"""Streams that outlive their prefill: the router's side (the wire contract: ``pdserve.stream_resume``).

``EventRelay`` follows one relayed SSE stream across the prefills that serve it. ``feed(chunk)``
returns the bytes for the client: whole events only, each with the prefill's extension cut out
(the rest of its bytes as the prefill wrote them); a partial event waits for its end and is
dropped when its upstream breaks (``restart``), so the client never gets half an event and the
relay knows exactly the tokens the client has. It keeps those tokens, the stream's ``id`` and
``created``, whether the finish event, the usage event and ``[DONE]`` went out, and whether the
stream can be resumed (``can_resume``: something went out, every event carried the extension --
a stream of several choices, with echo or tools, or one that ended in an error event never does
-- and ``[DONE]`` did not). After a ``restart`` (a resumed upstream) an event without the
extension other than an error event breaks the contract (a prefill that does not know it):
``broken`` says why and nothing more of that upstream reaches the client.

``resume(...)`` continues an HTTP stream whose prefill broke after the client got part of it: another
prefill (``relay.Relay.next_resume``: never one that failed this request; the request's ranking with its
tokens so far as the prompt, waiting up to ``--prefill-wait`` for one) gets the client's body with ``pdserve_resume``
(``resume_body``) and the request's deadline left (``X-Request-Timeout``), and its events go to the
same client response; a break there resumes again. When only ``[DONE]`` is missing it is written
here. It returns None once the stream ended, else why it could not be continued (the caller ends
the stream with an error event, as for a stream that cannot be resumed; only ``[DONE]`` when an
error event already went out: ``error_sent``).
"""

from __future__ import annotations

import json
import logging
import time

import aiohttp

from pdserve.defaults import REQUEST_TIMEOUT_HEADER
from pdserve.stream_resume import EVENT_KEY, RESUMABLE_HEADER, RESUME_FIELD

log = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"
_MARK = b',"' + EVENT_KEY.encode() + b'":'  # the extension is the event's last key (no spaces)
_ERROR = b'data: {"error":'


class StreamCut(Exception):
    """An upstream stream ended before ``[DONE]``, or broke the contract."""


def is_sse(upstream) -> bool:
    return upstream.headers.get("Content-Type", "").startswith("text/event-stream")


def split_event(event: bytes) -> tuple[bytes, dict | None]:
    """(the event without the extension, the extension) of one event's bytes; (event, None) without one."""
    body = event.rstrip(b"\n")
    at = body.rfind(_MARK)
    if at < 0 or not body.endswith(b"}}"):
        return event, None
    try:
        ext = json.loads(body[at + len(_MARK):-1])
    except ValueError:
        return event, None
    ids = ext.get("token_ids") if isinstance(ext, dict) else None
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return event, None
    return body[:at] + b"}" + event[len(body):], ext


class EventRelay:
    def __init__(self):
        self.token_ids: list[int] = []
        self.id: str | None = None
        self.created: int | None = None
        self.finish_reason: str | None = None  # the finish event went out with it
        self.usage_sent = False
        self.done = False  # [DONE] went out
        self.events = 0  # events that went out
        self.plain = False  # an event without the extension went out
        self.error_sent = False  # an error event went out (the prefill ended the stream with one)
        self.strict = False  # a resumed upstream: every event but an error one must carry the extension
        self.broken: str | None = None
        self.read_at: float | None = None  # perf_counter when the last upstream chunk was read (residence.py)
        self._buf = b""

    @property
    def can_resume(self) -> bool:
        return self.events > 0 and not self.plain and not self.done and self.id is not None

    @property
    def only_done_left(self) -> bool:
        return self.usage_sent

    def restart(self) -> None:
        """The upstream broke: drop its partial event; the next one is a resumed upstream."""
        self._buf, self.strict, self.broken = b"", True, None

    def feed(self, chunk: bytes) -> bytes:
        self._buf += chunk
        out = []
        while self.broken is None and (end := self._buf.find(b"\n\n")) >= 0:
            event, self._buf = self._buf[:end + 2], self._buf[end + 2:]
            shown = self._event(event)
            if shown is not None:
                out.append(shown)
                self.events += 1
        return b"".join(out)

    def _event(self, event: bytes) -> bytes | None:
        if event.startswith(DONE):
            self.done = True
            return event
        shown, ext = split_event(event)
        if ext is None:
            error = event.startswith(_ERROR)
            if self.strict and not error:
                self.broken = f"an event without {EVENT_KEY!r} in a resumed stream: {event[:80]!r}"
                return None
            self.plain, self.error_sent = True, self.error_sent or error
            return event
        if self.id is None:
            try:
                head = json.loads(shown[len(b"data: "):])
                self.id, self.created = head["id"], head["created"]
            except (ValueError, KeyError, TypeError):
                self.broken = f"an event without id and created: {event[:80]!r}"
                return None
        self.token_ids += ext["token_ids"]
        if ext.get("finish_reason") is not None:
            self.finish_reason = ext["finish_reason"]
        if ext.get("usage"):
            self.usage_sent = True
        return shown


def resume_body(body: bytes, relay: EventRelay) -> bytes:
    """The client's body with the resume field for what ``relay`` sent."""
    doc = json.loads(body)
    field = {"token_ids": relay.token_ids, "id": relay.id, "created": relay.created}
    if relay.finish_reason is not None:
        field["finish_reason"] = relay.finish_reason
    doc[RESUME_FIELD] = field
    return json.dumps(doc).encode()


async def pipe(upstream, relay: EventRelay, write) -> None:
    """``upstream``'s events through ``relay`` to ``write`` until ``[DONE]``; StreamCut when it ends before
    (or breaks the contract), aiohttp.ClientError when it breaks."""
    async for chunk in upstream.content.iter_any():
        relay.read_at = time.perf_counter()
        out = relay.feed(chunk)
        if out:
            await write(out)
        if relay.broken is not None:
            raise StreamCut(relay.broken)
    if not relay.done:
        raise StreamCut("the stream ended without [DONE]")


def _reason(address: str, status: int, data: bytes) -> str:
    try:
        message = json.loads(data)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = data[:200].decode(errors="replace")
    return f"{address} answered {status}: {message}"


async def resume(relay, session, path: str, body: bytes, events: EventRelay, write,
                 forwarded: dict[str, str]) -> str | None:
    """Continue ``events``' stream (see the module doc). ``relay``: the request's ``relay.Relay`` (which prefill,
    in flight, the deadline); ``session``: the aiohttp session; ``path``: the request's; ``write``: to the client."""
    while True:
        events.restart()
        if events.only_done_left:  # the usage event went out: [DONE] is all that is missing
            await write(DONE)
            events.done = True
            return None
        attempt = await relay.next_resume(events.token_ids)
        if attempt is None:
            return relay.gave_up
        try:
            data = resume_body(body, events)
        except (ValueError, TypeError):  # the prefill read it (it streamed), so this is not expected
            return "the request's body cannot be read as JSON to resume it"
        headers = {"Content-Type": "application/json", **forwarded, RESUMABLE_HEADER: "1",
                   REQUEST_TIMEOUT_HEADER: f"{attempt.time_left:.3f}"}
        log.info("resuming a stream on %s after %d tokens", attempt.address, len(events.token_ids))
        with attempt:
            attempt.count()
            why = await _resume_on(session, attempt, path, data, headers, events, write)
        if why is None:
            return None
        attempt.broke(why)
        if not events.can_resume:
            return "; ".join(relay.reasons[-4:])


async def _resume_on(session, attempt, path: str, data: bytes, headers: dict, events: EventRelay, write) -> str | None:
    """``attempt``'s prefill continues the stream: None once it ended, else why not."""
    upstream = None
    try:
        upstream = await session.post(attempt.watch.http_url + path, data=data, headers=headers)
        if upstream.status != 200 or not is_sse(upstream):
            return _reason(attempt.address, upstream.status, await upstream.read())
        await pipe(upstream, events, write)
        return None
    except (aiohttp.ClientError, StreamCut) as exc:
        log.warning("prefill %s failed resuming a stream: %s", attempt.address, exc)
        return f"{attempt.address}: {type(exc).__name__}: {exc}"
    finally:
        if upstream is not None:
            if upstream.content.at_eof():
                upstream.release()
            else:
                upstream.close()
