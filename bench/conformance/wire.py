"""HTTP for the conformance suite: every request bounded in time, every answer recorded as seen.

``Endpoint`` is one OpenAI-compatible server (its base URL, the model, an optional API key,
whether requests carry the ``ignore_eos`` extension) with two ways to talk to it:

- ``post(path, body)``: one request, the whole answer read -> ``Reply`` (status, headers,
  text, the decoded JSON or None). ``body`` may be raw bytes (invalid JSON on purpose).
- ``stream(path, body, stop=None)``: an SSE response read line by line -> ``StreamReply``:
  every non-empty line, every ``data:`` payload decoded (or kept as a decode error),
  how many ``[DONE]`` came and whether anything came after the first, and how it ended:
  cleanly (end of body), by a transport error (connection reset, body cut before its
  chunked-encoding end: the server process went away), by the hang guard, or closed by us
  (``stop(event)`` returned True: the client walks away mid-stream).

Time bounds (the hang guard): no byte for ``hang_s`` seconds, or more than ``total_s`` in all,
ends the request with ``hung`` set (a non-streamed answer comes in one piece at its end, so
it must come within the smaller of the two); nothing here ever waits without a bound. Neither method
raises for what the server or the network does: that is what the checks judge.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Callable

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
PATHS = {"completions": COMPLETIONS, "chat": CHAT}


@dataclass(slots=True)
class Reply:
    status: int = 0                 # 0: no HTTP answer (see error)
    headers: dict = field(default_factory=dict)
    text: str = ""
    json: object = None             # the decoded body, None if it is not JSON
    error: str = ""                 # transport error or hang guard ("" when an HTTP answer came)
    hung: bool = False
    seconds: float = 0.0

    def short(self) -> str:
        if self.status == 0:
            return self.error or "no answer"
        return f"HTTP {self.status}: {self.text[:200]}"


@dataclass(slots=True)
class StreamReply:
    status: int = 0
    content_type: str = ""
    body_text: str = ""             # the body when status != 200
    body_json: object = None
    lines: list[str] = field(default_factory=list)       # every non-empty line, in order
    payloads: list[str] = field(default_factory=list)    # every data: payload (stripped), [DONE] included
    events: list[dict] = field(default_factory=list)     # the JSON payloads, in order
    bad_json: list[str] = field(default_factory=list)    # data: payloads that are not a JSON object
    done_count: int = 0
    after_done: list[str] = field(default_factory=list)  # lines after the first [DONE]
    ended: bool = False             # the body ended (EOF) without a transport error
    closed_by_client: bool = False  # stop() asked to walk away
    error: str = ""                 # transport error, or the hang guard
    hung: bool = False
    longest_silence: float = 0.0
    seconds: float = 0.0

    def error_events(self) -> list[dict]:
        return [e for e in self.events if "error" in e]

    def short(self) -> str:
        if self.status == 0:
            return self.error or "no answer"
        if self.status != 200:
            return f"HTTP {self.status}: {self.body_text[:200]}"
        return self.error or f"{len(self.events)} events, [DONE] x{self.done_count}"


@dataclass(slots=True)
class Endpoint:
    """One OpenAI-compatible server. ``url`` is the base (``http://host:port``; a trailing /v1 is dropped)."""

    url: str
    model: str = ""
    api_key: str = ""
    ignore_eos: bool = True
    hang_s: float = 60.0
    total_s: float = 300.0
    session: object = None          # an aiohttp.ClientSession, opened by open()

    def __post_init__(self) -> None:
        url = self.url.rstrip("/")
        if url.endswith("/v1"):
            url = url[:-3]
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"a URL must start with http:// or https://, got {self.url!r}")
        self.url = url
        if self.hang_s <= 0 or self.total_s <= 0:
            raise ValueError("hang_s and total_s must be > 0")

    async def open(self) -> None:
        import aiohttp

        # a fresh connection per request: a server killed mid-run never hands us a dead pooled socket
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    def headers(self) -> dict:
        out = {"Content-Type": "application/json"}
        if self.api_key:
            out["Authorization"] = f"Bearer {self.api_key}"
        return out

    def body(self, api: str, prompt: str, max_tokens: int, **extra) -> dict:
        """A request body for ``api`` ("completions" or "chat"): greedy unless ``extra`` says otherwise."""
        body: dict = {"model": self.model, "max_tokens": max_tokens, "temperature": 0.0}
        if api == "completions":
            body["prompt"] = prompt
        else:
            body["messages"] = [{"role": "user", "content": prompt}]
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(extra)
        return body

    async def post(self, path: str, body: dict | bytes | None = None, method: str = "POST",
                   headers: dict | None = None) -> Reply:
        reply = Reply()
        t0 = time.monotonic()
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        try:
            async with asyncio.timeout(min(self.total_s, self.hang_s)):
                async with self.session.request(method, self.url + path, data=data,
                                                headers=headers or self.headers()) as resp:
                    reply.status, reply.headers = resp.status, dict(resp.headers)
                    raw = await resp.read()
        except TimeoutError:
            reply.hung, reply.error = True, f"hang guard: no whole answer within {min(self.total_s, self.hang_s):g}s"
            reply.seconds = time.monotonic() - t0
            return reply
        except Exception as e:  # noqa: BLE001 - aiohttp's connection errors: recorded, judged by the caller
            reply.error = f"transport: {type(e).__name__}: {e}"
            reply.seconds = time.monotonic() - t0
            return reply
        reply.seconds = time.monotonic() - t0
        reply.text = raw.decode("utf-8", "replace")
        try:
            reply.json = json.loads(reply.text)
        except ValueError:
            reply.json = None
        return reply

    async def get(self, path: str) -> Reply:
        return await self.post(path, None, method="GET", headers={} if not self.api_key else
                               {"Authorization": f"Bearer {self.api_key}"})

    async def stream(self, path: str, body: dict, stop: Callable[[dict], bool] | None = None) -> StreamReply:
        """POST a streaming request and read its SSE body (see the module docstring)."""
        out = StreamReply()
        t0 = last = time.monotonic()

        def silence(now: float) -> None:
            out.longest_silence = max(out.longest_silence, now - last)

        try:
            async with self.session.post(self.url + path, data=json.dumps(body).encode(),
                                         headers=self.headers()) as resp:
                out.status, out.content_type = resp.status, resp.headers.get("Content-Type", "")
                if resp.status != 200:
                    async with asyncio.timeout(self.hang_s):
                        raw = await resp.read()
                    out.body_text = raw.decode("utf-8", "replace")
                    try:
                        out.body_json = json.loads(out.body_text)
                    except ValueError:
                        pass
                    out.ended = True
                    return out
                while True:
                    now = time.monotonic()
                    budget = min(self.hang_s, self.total_s - (now - t0))
                    if budget <= 0:
                        raise TimeoutError
                    async with asyncio.timeout(budget):
                        raw = await resp.content.readline()
                    now = time.monotonic()
                    silence(now)
                    last = now
                    if not raw:
                        out.ended = True
                        break
                    if (self._line(out, raw.decode("utf-8", "replace").strip())
                            and stop is not None and stop(out.events[-1])):
                        out.closed_by_client = True
                        resp.close()  # drops the connection: the server sees the client go away
                        break
        except TimeoutError:
            now = time.monotonic()
            silence(now)
            out.hung = True
            out.error = (f"hang guard: no byte for {self.hang_s:g}s" if now - last >= self.hang_s - 0.01
                         else f"hang guard: not done within {self.total_s:g}s")
        except Exception as e:  # noqa: BLE001 - the server went away mid-body, or refused the connection
            silence(time.monotonic())
            out.error = f"transport: {type(e).__name__}: {e}"
        finally:
            out.seconds = time.monotonic() - t0
        return out

    @staticmethod
    def _line(out: StreamReply, line: str) -> bool:
        """Record one line; True when it was a JSON event (now ``out.events[-1]``)."""
        if not line:
            return False
        out.lines.append(line)
        if out.done_count:
            out.after_done.append(line)
        if not line.startswith("data:"):
            return False
        data = line[5:].strip()
        out.payloads.append(data)
        if data == "[DONE]":
            out.done_count += 1
            return False
        try:
            event = json.loads(data)
        except ValueError:
            out.bad_json.append(data[:200])
            return False
        if not isinstance(event, dict):
            out.bad_json.append(data[:200])
            return False
        out.events.append(event)
        return True


# -- reading events (the shapes of /v1/completions and chat chunks) ---------------------------
def choice_text(choice: dict, api: str) -> str | None:
    """The text a choice (whole or streamed) carries: completions' ``text``, chat's
    ``message.content`` / ``delta.content``; None when it carries no text field."""
    if api == "completions":
        return choice.get("text")
    inner = choice.get("delta") if "delta" in choice else choice.get("message")
    return (inner or {}).get("content")


def logprob_tokens(choice: dict, api: str) -> list[str] | None:
    """The tokens a choice's ``logprobs`` object lists (None when it has no logprobs object)."""
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return None
    if api == "completions":
        tokens = lp.get("tokens")
        return list(tokens) if isinstance(tokens, list) else None
    content = lp.get("content")
    if content is None:
        return []
    return [c.get("token") for c in content] if isinstance(content, list) else None


def stream_choices(events: list[dict]) -> list[dict]:
    """Every choice entry of every event, in order (usage and error events carry none)."""
    return [c for e in events for c in (e.get("choices") or []) if isinstance(c, dict)]


def joined_text(events: list[dict], api: str, index: int = 0) -> str:
    return "".join(choice_text(c, api) or "" for c in stream_choices(events) if c.get("index", 0) == index)


def finish_reasons(events: list[dict], index: int = 0) -> list[str]:
    return [c["finish_reason"] for c in stream_choices(events) if c.get("index", 0) == index and c.get("finish_reason")]


def token_events(events: list[dict], api: str) -> int:
    """Events that carry a generated token, judged without logprobs: a choice entry without a
    finish_reason that has a text field (vLLM and pdserve send one per token, its text possibly "")."""
    return sum(1 for c in stream_choices(events) if c.get("finish_reason") is None and choice_text(c, api) is not None)
