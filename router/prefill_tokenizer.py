"""PrefillTokenizer: the router's tokenizer taken from a prefill (``pdserve router --tokenizer-from-prefill``).

A router whose model is on a claim mounts no volume (operator/model_pods.py): it asks a prefill for
the model's config and tokenizer files instead (``GET /tokenizer``, ``pdserve.tokenizer_files``).
``load()``, at start, while the router already serves:

1. **wait** - for a prefill that discovery names and that answers its load polls (which give its
   HTTP port; it need not have a decode yet), checked every ``retry_s``; while there is none, a
   warning every ``REPORT_S`` says what discovery gives;
2. **fetch** - ``GET /tokenizer`` from each such prefill in turn until one answers; a failure (an
   error status, a connection error, an answer of another format) is logged (a warning when it
   differs from the last one) and the next one or, after ``retry_s``, the same one again is asked;
3. **load** - the files into a temporary directory, the tokenizer from it (``prompt.load_tokenizer``,
   as ``--model DIR``: no tokenizer.json means the byte-level tokenizer), the directory removed.

Until ``load()`` returns, the router's tokenizer is None: /ready is 503 with ``why_not()`` as its
reason, and requests (if any reach it) are routed by load alone. No prefill's files within
``wait_s``: ``TokenizerUnavailable``, one line naming what discovery gave and the last failure;
the router then exits with status 1.
"""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
import time
from pathlib import Path

import aiohttp

from pdserve import tokenizer_files

from .prefills import PrefillSet
from .prompt import load_tokenizer

log = logging.getLogger(__name__)
RETRY_S = 1.0  # between two rounds of asking the prefills
REPORT_S = 10.0  # between two warnings while no prefill answers
FETCH_TIMEOUT_S = 60.0  # one GET /tokenizer (tens of MB at most)


class TokenizerUnavailable(Exception):
    """No prefill gave its tokenizer files in time; the message is the one line the operator sees."""


class _FetchFailed(Exception):
    pass


class PrefillTokenizer:
    def __init__(self, prefills: PrefillSet, wait_s: float, retry_s: float = RETRY_S, api_key: bytes | None = None):
        """``api_key``: sent as ``Authorization: Bearer`` (prefills behind API keys take the router's)."""
        self.prefills, self.wait_s, self.retry_s = prefills, wait_s, retry_s
        self.headers = {"Authorization": "Bearer " + api_key.decode()} if api_key else {}
        self.source: str | None = None  # the prefill the files came from, once loaded
        self.files: list[str] = []
        self.last_failure = ""

    def state(self) -> dict:
        """For /health: where the tokenizer came from, or what it waits for."""
        if self.source is not None:
            return {"from": "prefill", "loaded": True, "prefill": self.source, "files": self.files}
        return {"from": "prefill", "loaded": False, "waiting": self.why_not()}

    def why_not(self) -> str:
        """Why there is no tokenizer yet, in one line."""
        named = sorted(self.prefills.discovery.addresses())
        if not named:
            return "waiting for a prefill to take the tokenizer from: discovery names none yet"
        answering = [w.address for w in self._answering()]
        if not answering:
            return (f"waiting for a prefill to take the tokenizer from: {', '.join(named)} named by discovery, "
                    "none answers yet")
        return f"fetching the tokenizer from {', '.join(answering)}" + (
            f" (last failure: {self.last_failure})" if self.last_failure else "")

    def _answering(self) -> list:
        """Watches of prefills whose last load poll answered, routable ones first."""
        watches = [w for _, w in sorted(self.prefills.watches.items()) if w.load is not None and w.load.http_port > 0]
        return sorted(watches, key=lambda w: not w.routable())

    async def load(self):
        """The tokenizer, from the first prefill that gives its files; TokenizerUnavailable after ``wait_s``."""
        deadline = time.monotonic() + self.wait_s
        next_report = time.monotonic() + REPORT_S
        timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S, sock_connect=5.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                for watch in self._answering():
                    try:
                        doc = await self._fetch(session, watch.http_url + tokenizer_files.ROUTE)
                        tokenizer, files = await asyncio.to_thread(_load, doc)
                    except _FetchFailed as exc:
                        failure = f"{watch.address}: {exc}"
                        # a warning when it changes; the same failure again (every retry_s) only at debug level
                        log.log(logging.DEBUG if failure == self.last_failure else logging.WARNING,
                                "tokenizer from prefill %s (%s): %s; asking again", watch.address, watch.http_url, exc)
                        self.last_failure = failure
                        continue
                    self.source, self.files = watch.address, files
                    log.info("tokenizer from prefill %s (%s, model %s): %s", watch.address, watch.http_url,
                             doc.get("model"), ", ".join(files) if files else "no files: the built-in byte tokenizer")
                    return tokenizer
                now = time.monotonic()
                if now >= deadline:
                    raise TokenizerUnavailable(f"no prefill gave its tokenizer within {self.wait_s:g}s "
                                               f"(--tokenizer-wait): {self.why_not()}")
                if now >= next_report:
                    log.warning("%s", self.why_not())
                    next_report = now + REPORT_S
                await asyncio.sleep(min(self.retry_s, max(0.0, deadline - now)))

    async def _fetch(self, session: aiohttp.ClientSession, url: str) -> dict:
        try:
            async with session.get(url, headers=self.headers) as resp:
                body = bytearray()
                async for chunk in resp.content.iter_chunked(1 << 16):
                    body += chunk
                    if len(body) > tokenizer_files.MAX_ANSWER_BYTES:
                        raise _FetchFailed(f"answer over the limit of {tokenizer_files.MAX_ANSWER_BYTES} bytes")
                if resp.status != 200:
                    raise _FetchFailed(f"HTTP {resp.status}: {_message(body, resp.status)}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _FetchFailed(f"{type(exc).__name__}: {exc}") from None
        try:
            return json.loads(body)
        except ValueError:
            raise _FetchFailed("the answer is not JSON") from None


def _load(doc: dict):
    """(tokenizer, file names) from an answer, through a temporary directory (removed after)."""
    with tempfile.TemporaryDirectory(prefix="pdserve-tokenizer-") as folder:
        try:
            files = tokenizer_files.unpack(doc, Path(folder))
            return load_tokenizer(folder), files
        except tokenizer_files.TokenizerFilesError as exc:
            raise _FetchFailed(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - a tokenizer.json the tokenizers library refuses, say
            raise _FetchFailed(f"its files do not load: {type(exc).__name__}: {exc}") from None


def _message(body: bytes | bytearray, status: int) -> str:
    """An OpenAI error body's message, else what the status means here, else the start of the body."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        if status == 404:
            return f"no {tokenizer_files.ROUTE} there (a pdserve older than this router?)"
        return body[:200].decode("utf-8", "replace").strip() or "(empty body)"
