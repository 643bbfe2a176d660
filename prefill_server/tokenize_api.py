"""POST /tokenize and POST /detokenize on the prefill's HTTP port: vLLM's server routes, in its shapes,
for the clients that call them (``vllm bench serve`` re-aligns its random prompts through them; scripts
count a prompt's tokens before sending it).

- ``/tokenize`` ``{"prompt": "...", "add_special_tokens": true}``: the ids /v1/completions computes for
  that prompt (``add_special_tokens`` false: without the BOS the tokenizer adds); ``{"messages": [...]}``:
  the ids /v1/chat/completions computes for that conversation (the chat template, the generation
  prompt after it; ``tools`` as the chat route takes them). Answer: ``{"count", "max_model_len",
  "tokens", "token_strs": null}``.
- ``/detokenize`` ``{"tokens": [...]}``: ``{"prompt": "<their text>"}``.

``model``, when given, must be the served one, as on the OpenAI routes. Bad input: 400 with an OpenAI
error body naming the field (``tokens`` outside the vocabulary included). The engine is not involved:
the tokenizer runs here, as for a request's prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from . import openai_api as oa

if TYPE_CHECKING:
    from .frontend import Frontend

__all__ = ["add_routes"]


def tokenize(fe: Frontend, body: dict) -> dict:
    """/tokenize's answer for a decoded JSON body (BadRequest naming the field)."""
    body = {"model": fe.model_name, **body}  # optional here
    oa.check_model(body["model"], fe.model_name)
    if "messages" in body:
        if "prompt" in body:
            raise oa.BadRequest("give either prompt or messages, not both", "prompt")
        ids = fe.prompt_ids(oa.parse_chat(body, fe.model_name, fe.max_model_len, fe.vocab_size))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise oa.BadRequest(f"prompt must be a string (or give messages), got {type(prompt).__name__}", "prompt")
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise oa.BadRequest("add_special_tokens must be a boolean", "add_special_tokens")
        ids = fe.tokenizer.encode(prompt, add_special_tokens=special)
    return {"count": len(ids), "max_model_len": fe.max_model_len, "tokens": ids, "token_strs": None}


def detokenize(fe: Frontend, body: dict) -> dict:
    """/detokenize's answer for a decoded JSON body (BadRequest naming the field)."""
    oa.check_model(body.get("model", fe.model_name), fe.model_name)
    if "tokens" not in body:
        raise oa.BadRequest("missing required field 'tokens'", "tokens")
    ids = oa.check_token_ids(body["tokens"], "tokens", fe.vocab_size)
    return {"prompt": fe.tokenizer.decode(ids, skip_special_tokens=False)}


def add_routes(app: web.Application, fe: Frontend) -> None:
    def route(answer):
        async def handler(request: web.Request) -> web.Response:
            try:
                return web.json_response(answer(fe, oa.parse_json(await request.read())))
            except oa.BadRequest as exc:
                return web.json_response(oa.error_body(exc.message, "invalid_request_error", exc.param, exc.code),
                                         status=400)
        return handler

    app.router.add_post("/tokenize", route(tokenize))
    app.router.add_post("/detokenize", route(detokenize))
