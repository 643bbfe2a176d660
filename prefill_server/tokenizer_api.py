"""GET /tokenizer on the prefill's HTTP port: its model's config and tokenizer files, for a router
that mounts no model (``pdserve router --tokenizer-from-prefill``).

The answer is ``pdserve.tokenizer_files``'s (JSON, the files in base64; none for a built-in model,
which means the byte-level tokenizer). Files over ``tokenizer_files.MAX_BYTES`` in all, or one that
cannot be read: 500 with an OpenAI error body (``tokenizer_too_large`` / ``tokenizer_unreadable``)
naming the model. The files are read per request, off the event loop (a router asks once, at start).
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from pdserve import tokenizer_files

from . import openai_api as oa

log = logging.getLogger(__name__)


def add_routes(app: web.Application, model: str) -> None:
    """``model``: the server's ``--model`` (a directory, or a built-in name)."""

    async def tokenizer(request: web.Request) -> web.Response:
        try:
            doc = await asyncio.to_thread(tokenizer_files.pack, model)
        except tokenizer_files.TokenizerFilesError as exc:
            return web.json_response(oa.error_body(str(exc), "server_error", code="tokenizer_too_large"), status=500)
        except OSError as exc:
            message = f"cannot read the tokenizer files of {model}: {exc}"
            log.error("%s", message)
            return web.json_response(oa.error_body(message, "server_error", code="tokenizer_unreadable"), status=500)
        log.info("tokenizer files of %s sent to %s: %s", model, request.remote,
                 sorted(doc["files"]) or "none (built in)")
        return web.json_response(doc)

    app.router.add_get(tokenizer_files.ROUTE, tokenizer)
