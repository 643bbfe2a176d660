"""Bad input: every malformed request gets a 4xx with an OpenAI-shaped error body, at once.

One check per case (``bad-input.<case>``). A case passes when the answer is a 4xx status
whose body is JSON ``{"error": {"message": str, "type": str, ...}}`` (the shape the
``openai`` client turns into an exception carrying the message; a missing ``param`` or
``code`` key is noted, not failed). It fails on a 2xx (the server accepted garbage: it will
guess, or fail later where the client cannot tell why), a 5xx (the server broke on client
input: load balancers retry it, alerts fire), a body of another shape, or no answer within
the hang guard. Then ``bad-input.still-serving``: after all of them, a good request is served.

Cases: model missing, prompt missing, messages missing, max_tokens negative / a string /
beyond any context (10^9) / beyond this model's context for this prompt, a prompt longer
than the context (these two when the context length is known), a streaming request with a
negative max_tokens (the error must come as a 4xx status, not inside a 200 event stream), n
absurd (10^6) / 0, temperature a string / negative, prompt an object, messages a string, a
message with an unknown role, stream a string, a body that is not JSON, a JSON body that is
not an object, an unknown model name.

OpenAI answers an unknown model with 404; pdserve answers 400 (code ``model_not_found``), as
does any 4xx here: the detail names the status so a deviation is visible.
"""

from __future__ import annotations

from .runner import Check, Context
from .verdict import Outcome, Problems
from .wire import CHAT, COMPLETIONS

GOOD_MESSAGES = [{"role": "user", "content": "Hello"}]
_DROP = object()  # a field to leave out of the body


def _completion(ctx: Context, **fields) -> dict:
    body = {"model": ctx.ep.model, "prompt": "Hello", "max_tokens": 4}
    body.update(fields)
    return {k: v for k, v in body.items() if v is not _DROP}


def _chat(ctx: Context, **fields) -> dict:
    body = {"model": ctx.ep.model, "messages": GOOD_MESSAGES, "max_tokens": 4}
    body.update(fields)
    return {k: v for k, v in body.items() if v is not _DROP}


# slug -> (path, body builder); a builder returning None leaves the case out of this run
CASES = {
    "missing-model": (COMPLETIONS, lambda c: _completion(c, model=_DROP)),
    "missing-prompt": (COMPLETIONS, lambda c: _completion(c, prompt=_DROP)),
    "missing-messages": (CHAT, lambda c: _chat(c, messages=_DROP)),
    "negative-max-tokens": (COMPLETIONS, lambda c: _completion(c, max_tokens=-5)),
    "string-max-tokens": (COMPLETIONS, lambda c: _completion(c, max_tokens="ten")),
    "huge-max-tokens": (COMPLETIONS, lambda c: _completion(c, max_tokens=10**9)),
    "max-tokens-beyond-context": (COMPLETIONS, lambda c: _completion(c, max_tokens=c.max_model_len)
                                  if c.max_model_len else None),
    "prompt-beyond-context": (COMPLETIONS, lambda c: _completion(c, prompt="hello " * (c.max_model_len + 8))
                              if c.max_model_len else None),
    "stream-negative-max-tokens": (COMPLETIONS, lambda c: _completion(c, max_tokens=-5, stream=True)),
    "absurd-n": (COMPLETIONS, lambda c: _completion(c, n=10**6)),
    "zero-n": (COMPLETIONS, lambda c: _completion(c, n=0)),
    "string-temperature": (COMPLETIONS, lambda c: _completion(c, temperature="hot")),
    "negative-temperature": (COMPLETIONS, lambda c: _completion(c, temperature=-1.0)),
    "object-prompt": (COMPLETIONS, lambda c: _completion(c, prompt={"text": "Hello"})),
    "string-messages": (CHAT, lambda c: _chat(c, messages="Hello")),
    "unknown-role": (CHAT, lambda c: _chat(c, messages=[{"role": "wizard", "content": "Hello"}])),
    "string-stream": (COMPLETIONS, lambda c: _completion(c, stream="yes")),
    "invalid-json": (COMPLETIONS, lambda c: b'{"model": "m", "prompt": "Hello", "max_tokens": '),
    "non-object-json": (COMPLETIONS, lambda c: b'["Hello", 4]'),
    "unknown-model": (COMPLETIONS, lambda c: _completion(c, model=c.ep.model + "-no-such-model")),
}


def checks(ctx: Context) -> list[Check]:
    out = [Check(f"bad-input.{slug}", "bad-input", lambda c, s=slug: one_case(c, s)) for slug in CASES]
    out.append(Check("bad-input.still-serving", "bad-input", still_serving))
    return out


def error_shape(body) -> tuple[list[str], list[str]]:
    """(problems, notes) of an error body against OpenAI's ``{"error": {"message", "type", "param", "code"}}``."""
    if not isinstance(body, dict):
        return ["the body is not a JSON object"], []
    err = body.get("error")
    if not isinstance(err, dict):
        return [f"no 'error' object in {str(body)[:120]}"], []
    problems = []
    if not isinstance(err.get("message"), str) or not err["message"]:
        problems.append("error.message is not a non-empty string")
    if not isinstance(err.get("type"), str):
        problems.append("error.type is not a string")
    missing = [k for k in ("param", "code") if k not in err]
    return problems, [f"error has no {', '.join(missing)} key"] if missing else []


async def one_case(ctx: Context, slug: str) -> Outcome:
    path, build = CASES[slug]
    body = build(ctx)
    if body is None:
        return Outcome("SKIP", "the model's context length is unknown (pass --max-model-len)")
    reply = await ctx.ep.post(path, body)  # bytes go out as they are (invalid JSON on purpose)
    p = Problems()
    if reply.status == 0:
        p.add(reply.error)
        return p.outcome("")
    p.check(400 <= reply.status < 500, f"HTTP {reply.status}, not 4xx: {reply.text[:160]}")
    shape, notes = error_shape(reply.json)
    for problem in shape:
        p.add(problem)
    for note in notes:
        p.note(note)
    if slug == "unknown-model" and reply.status != 404 and 400 <= reply.status < 500:
        p.note(f"OpenAI answers 404 here, this server {reply.status}")
    message = reply.json["error"].get("message", "") if not shape else ""
    return p.outcome(f"HTTP {reply.status}: {message[:160]}", status=reply.status, body=reply.text[:500])


async def still_serving(ctx: Context) -> Outcome:
    reply = await ctx.ep.post(COMPLETIONS, ctx.ep.body("completions", ctx.prompts[0], min(ctx.lengths)))
    p = Problems()
    choices = reply.json.get("choices") if isinstance(reply.json, dict) else None
    p.check(reply.status == 200 and bool(choices), f"a good request after the bad ones: {reply.short()}")
    return p.outcome("a good request after all the bad ones: HTTP 200")
