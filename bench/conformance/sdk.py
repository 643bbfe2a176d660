"""Client: what the official ``openai`` Python client makes of the server's answers.

The raw-HTTP checks judge the bytes; these judge what most applications actually run: the
``openai`` package's ``AsyncOpenAI`` (``base_url`` = --url + /v1, no retries, the hang guard as
its timeout) parses each answer into its typed objects, and must get the same answers:

- ``client.completions``: ``completions.create`` greedy: the text and usage equal the raw
  request's (the client parsed every field it needs);
- ``client.chat-stream``: ``chat.completions.create(stream=True, stream_options=
  {"include_usage": True})``: the deltas joined equal the non-streamed greedy text, the last
  chunk carries the usage, and the client's SSE decoder raised nothing;
- ``client.error``: an unknown model and a negative max_tokens raise the client's
  ``APIStatusError`` (BadRequestError / NotFoundError ...) with a 4xx status and the server's
  message, not an ``APIConnectionError`` or a 5xx ``InternalServerError``.

The ``openai`` package is not a dependency of pdserve (``pip install openai``, or pdserve's
dev extra): without it these checks are skipped.
"""

from __future__ import annotations

import asyncio

from .correctness import first_choice, usage_of
from .runner import Check, Context
from .verdict import Outcome, Problems, skipped
from .wire import choice_text


def checks(ctx: Context) -> list[Check]:
    return [Check("client.completions", "client", completions), Check("client.chat-stream", "client", chat_stream),
            Check("client.error", "client", error)]


def _client(ctx: Context):
    try:
        import openai
    except ImportError:
        return None
    return openai.AsyncOpenAI(base_url=ctx.ep.url + "/v1", api_key=ctx.ep.api_key or "none",
                              timeout=ctx.ep.total_s, max_retries=0)


def _extra(ctx: Context) -> dict:
    return {"extra_body": {"ignore_eos": True}} if ctx.ep.ignore_eos else {}


NO_CLIENT = "the openai package is not installed (pip install openai)"


async def completions(ctx: Context) -> Outcome:
    client = _client(ctx)
    if client is None:
        return skipped(NO_CLIENT)
    n = max(ctx.lengths)
    p = Problems()
    raw = await ctx.whole("completions", 0, n)
    want, why = first_choice(raw, "completions")
    if not p.check(want is not None, f"raw request: {why}"):
        return p.outcome("")
    async with client, asyncio.timeout(ctx.ep.total_s):
        got = await client.completions.create(model=ctx.ep.model, prompt=ctx.prompts[0], max_tokens=n, temperature=0,
                                              **_extra(ctx))
    p.check(len(got.choices) == 1, f"{len(got.choices)} choices")
    p.check(got.choices[0].text == want["text"], "the client's text differs from the raw answer's")
    p.check(got.choices[0].finish_reason == want.get("finish_reason"),
            f"finish_reason {got.choices[0].finish_reason!r}")
    u = usage_of(raw.json)
    p.check(got.usage is not None and got.usage.completion_tokens == u.get("completion_tokens")
            and got.usage.prompt_tokens == u.get("prompt_tokens"), f"usage {got.usage} vs {u}")
    return p.outcome(f"completions.create: same text ({n} tokens), finish_reason and usage as the raw answer")


async def chat_stream(ctx: Context) -> Outcome:
    client = _client(ctx)
    if client is None:
        return skipped(NO_CLIENT)
    n = max(ctx.lengths)
    p = Problems()
    raw = await ctx.whole("chat", 0, n)
    want, why = first_choice(raw, "chat")
    if not p.check(want is not None, f"raw request: {why}"):
        return p.outcome("")
    parts, usage, finish, chunks = [], None, [], 0
    async with client, asyncio.timeout(ctx.ep.total_s):
        stream = await client.chat.completions.create(
            model=ctx.ep.model, messages=[{"role": "user", "content": ctx.prompts[0]}], max_tokens=n, temperature=0,
            stream=True, stream_options={"include_usage": True}, **_extra(ctx))
        async for chunk in stream:
            chunks += 1
            for c in chunk.choices:
                parts.append(c.delta.content or "")
                if c.finish_reason:
                    finish.append(c.finish_reason)
            if chunk.usage is not None:
                usage = chunk.usage
    text = "".join(parts)
    p.check(text == choice_text(want, "chat"), "the streamed deltas joined differ from the non-streamed text")
    p.check(finish == [want.get("finish_reason")], f"finish_reasons {finish}")
    u = usage_of(raw.json)
    p.check(usage is not None and usage.completion_tokens == u.get("completion_tokens"),
            f"the last chunk's usage {usage} vs {u}")
    return p.outcome(f"chat.completions.create(stream=True): {chunks} chunks, text and usage as the whole answer")


async def error(ctx: Context) -> Outcome:
    client = _client(ctx)
    if client is None:
        return skipped(NO_CLIENT)
    import openai

    p = Problems()
    seen = []
    cases = (("unknown model", {"model": ctx.ep.model + "-no-such-model", "max_tokens": 4}),
             ("negative max_tokens", {"model": ctx.ep.model, "max_tokens": -5}))
    async with client:
        for name, fields in cases:
            try:
                async with asyncio.timeout(ctx.ep.total_s):
                    await client.completions.create(prompt="Hello", **fields)
                p.add(f"{name}: no exception (the server accepted it)")
            except openai.APIStatusError as e:
                seen.append(f"{name}: {type(e).__name__} {e.status_code}")
                p.check(400 <= e.status_code < 500, f"{name}: {type(e).__name__} with status {e.status_code}")
                body = e.body if isinstance(e.body, dict) else {}
                p.check(isinstance(body.get("message"), str) and body["message"] in str(e),
                        f"{name}: the client did not find the server's message (body {str(e.body)[:100]})")
            except openai.APIConnectionError as e:
                p.add(f"{name}: {type(e).__name__}: {e}")
    return p.outcome("; ".join(seen) + ", carrying the server's message")
