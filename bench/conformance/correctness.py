"""Correctness: the answers themselves, on /v1/completions and /v1/chat/completions.

Every request here is greedy (temperature 0) unless it says otherwise, and carries
``ignore_eos`` (the vLLM extension pdserve also takes; ``--no-ignore-eos`` leaves it out) so a
run of ``max_tokens`` is exactly that long. Cases are every prompt of the run x every
``--lengths`` value. What each check asserts, and why:

- ``models``: ``GET /v1/models`` is an OpenAI list holding the model: clients discover the
  model name there.
- ``greedy.<api>``: the text, finish_reason and completion_tokens of every case equal the
  reference endpoint's (``--reference-url``; e.g. a colocated server, where P/D must change
  nothing), or, without one, a second identical request's: greedy decoding is deterministic,
  so any difference is a bug in the serving path (KV transfer, batching, detokenization).
- ``stream.<api>``: each case streamed: the streamed texts joined, the finish_reason and the
  usage equal the non-streamed answer's: streaming is a transport, not another result.
- ``stop.<api>``: a stop string cut from the middle of a greedy text: the answer is that text up
  to the stop string's first occurrence, without it, and finish_reason is "stop", streamed and
  not; a stop string that leaks into the output, or a wrong finish_reason, breaks every
  client that relies on stop sequences.
- ``n.<api>``: ``n`` = 3 (sampled): 3 choices indexed 0, 1, 2, each with a finish_reason;
  streamed, every index appears, finishes exactly once and nothing of it comes after its
  finish; usage counts the tokens of all choices.
- ``logprobs.<api>``: greedy with 2 alternatives: one entry per generated token
  (completion_tokens of them), every logprob a finite number <= 0, 1-3 alternatives per token
  on /v1/completions (a dict keyed by token text: two alternatives that decode to the same text
  merge, and vLLM adds the sampled token when it is not among the top) and exactly 2 on chat,
  the greedy token's logprob >= every alternative's (it is the argmax); and asking for
  logprobs does not change the greedy text.
- ``usage.<api>``: prompt_tokens the same for one prompt whatever max_tokens and whether
  streamed; total = prompt + completion; completion_tokens == max_tokens when finish_reason is
  "length"; a stream with ``stream_options.include_usage`` has exactly one usage event, after
  the last choice event and before ``[DONE]``, with empty choices, whose completion_tokens
  equals the tokens streamed (counted from the streamed logprobs, one entry per token); a
  stream without it carries no usage.
- ``usage.tokenize``: where the server has a tokenizer endpoint (vLLM's ``POST /tokenize``),
  prompt_tokens equals the token count of the prompt, and completion_tokens the token count of
  the completion text (texts holding U+FFFD are left out: a token that ends inside a UTF-8
  character cannot be re-tokenized from its text). Skipped where there is none (pdserve had
  none before f239d2a).
- ``sse.<api>``: the raw event stream (with logprobs and usage): Content-Type
  text/event-stream; every line a ``data:`` line (or an SSE comment); every payload but the
  last valid JSON; exactly one ``data: [DONE]``, last, nothing after it; the same ``id``,
  the right ``object`` and a ``created`` and ``model`` in every event; one event per
  generated token (no event carries two; as many token events as completion_tokens), the
  tokens in the order of the non-streamed answer's logprobs; chat: the first event has
  ``delta.role`` "assistant".
"""

from __future__ import annotations

import math

from .runner import Check, Context
from .verdict import Outcome, Problems, skipped
from .wire import (PATHS, Endpoint, Reply, StreamReply, choice_text, finish_reasons, joined_text, logprob_tokens,
                   stream_choices)

APIS = ("completions", "chat")
N_CHOICES = 3
N_MAX_TOKENS = 8
TOP_LOGPROBS = 2
LOGPROB_EPS = 1e-5     # float32 log-softmax may round the top token's logprob a hair above 0
ARGMAX_EPS = 1e-4
OBJECTS = {"completions": ("text_completion", "text_completion"), "chat": ("chat.completion", "chat.completion.chunk")}


def checks(ctx: Context) -> list[Check]:
    out = [Check("models", "correctness", models)]
    for api in APIS:
        out.append(Check(f"greedy.{api}", "correctness", lambda c, a=api: greedy(c, a)))
        out.append(Check(f"stream.{api}", "correctness", lambda c, a=api: streamed(c, a)))
    for name, fn in (("stop", stop), ("n", n_choices), ("logprobs", logprobs), ("usage", usage)):
        for api in APIS:
            out.append(Check(f"{name}.{api}", "correctness", lambda c, a=api, f=fn: f(c, a)))
    out.append(Check("usage.tokenize", "correctness", tokenize))
    for api in APIS:
        out.append(Check(f"sse.{api}", "correctness", lambda c, a=api: sse(c, a)))
    return out


# -- helpers -----------------------------------------------------------------------------------
def first_choice(reply: Reply, api: str) -> tuple[dict | None, str]:
    """(choice 0 of a whole answer, "") or (None, why not)."""
    if reply.status != 200 or not isinstance(reply.json, dict):
        return None, reply.short()
    choices = reply.json.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None, f"no choices in {reply.text[:200]}"
    if choice_text(choices[0], api) is None:
        return None, f"choice 0 has no {'text' if api == 'completions' else 'message.content'}: {reply.text[:200]}"
    return choices[0], ""


def usage_of(body) -> dict:
    u = body.get("usage") if isinstance(body, dict) else None
    return u if isinstance(u, dict) else {}


def stream_body(ep: Endpoint, api: str, prompt: str, max_tokens: int, include_usage: bool = True, **extra) -> dict:
    body = ep.body(api, prompt, max_tokens, stream=True, **extra)
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    return body


def logprob_fields(api: str, top: int) -> dict:
    return {"logprobs": top} if api == "completions" else {"logprobs": True, "top_logprobs": top}


def stream_problem(s: StreamReply) -> str:
    """Why a stream did not end properly ("" when it did: 200, [DONE], no error)."""
    if s.status != 200:
        return s.short()
    if s.error:
        return s.error
    if s.error_events():
        return f"error event: {str(s.error_events()[0])[:200]}"
    if s.done_count != 1:
        return f"[DONE] came {s.done_count} times"
    return ""


def usage_events(s: StreamReply) -> list[dict]:
    return [e for e in s.events if isinstance(e.get("usage"), dict)]


def first_diff(a: str, b: str) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"differ at char {i}: {a[max(0, i - 10):i + 20]!r} vs {b[max(0, i - 10):i + 20]!r}"


def cases(ctx: Context) -> list[tuple[int, int]]:
    return [(p, n) for p in range(len(ctx.prompts)) for n in ctx.lengths]


def middle_length(ctx: Context) -> int:
    return min(ctx.lengths, key=lambda n: abs(n - 16))


# -- checks ------------------------------------------------------------------------------------
async def models(ctx: Context) -> Outcome:
    reply = await ctx.ep.get("/v1/models")
    p = Problems()
    body = reply.json if isinstance(reply.json, dict) else {}
    if p.check(reply.status == 200, f"GET /v1/models: {reply.short()}"):
        p.check(body.get("object") == "list", f"object is {body.get('object')!r}, not 'list'")
        ids = [m.get("id") for m in body.get("data") or [] if isinstance(m, dict)]
        p.check(ctx.ep.model in ids, f"model {ctx.ep.model!r} not among {ids}")
    return p.outcome(f"lists {ctx.ep.model!r}" + (f" (max_model_len {ctx.max_model_len})" if ctx.max_model_len else ""))


async def greedy(ctx: Context, api: str) -> Outcome:
    which = "ref" if ctx.ref is not None else "repeat"
    p, equal = Problems(), 0
    for prompt, n in cases(ctx):
        a, b = await ctx.whole(api, prompt, n), await ctx.whole(api, prompt, n, which)
        ca, why_a = first_choice(a, api)
        cb, why_b = first_choice(b, api)
        case = f"prompt {prompt} max_tokens {n}"
        if not p.check(ca is not None, f"{case}: {why_a}") or not p.check(cb is not None, f"{case} ({which}): {why_b}"):
            continue
        ta, tb = choice_text(ca, api), choice_text(cb, api)
        ok = p.check(ta == tb, f"{case}: texts {first_diff(ta, tb)}")
        ok &= p.check(ca.get("finish_reason") == cb.get("finish_reason"),
                      f"{case}: finish_reason {ca.get('finish_reason')!r} vs {cb.get('finish_reason')!r}")
        ua, ub = usage_of(a.json).get("completion_tokens"), usage_of(b.json).get("completion_tokens")
        ok &= p.check(ua == ub, f"{case}: completion_tokens {ua} vs {ub}")
        equal += ok
    against = f"the reference {ctx.ref.url}" if ctx.ref is not None else "a repeated request (no --reference-url)"
    return p.outcome(f"{equal}/{len(cases(ctx))} cases (prompts x max_tokens {list(ctx.lengths)}) equal to {against}",
                     equal=equal, cases=len(cases(ctx)))


async def streamed(ctx: Context, api: str) -> Outcome:
    p, equal = Problems(), 0
    for prompt, n in cases(ctx):
        case = f"prompt {prompt} max_tokens {n}"
        whole = await ctx.whole(api, prompt, n)
        cw, why = first_choice(whole, api)
        if not p.check(cw is not None, f"{case} (not streamed): {why}"):
            continue
        s = await ctx.ep.stream(PATHS[api], stream_body(ctx.ep, api, ctx.prompts[prompt], n))
        bad = stream_problem(s)
        if not p.check(not bad, f"{case}: stream {bad}"):
            continue
        text, want = joined_text(s.events, api), choice_text(cw, api)
        ok = p.check(text == want, f"{case}: streamed text {first_diff(text, want)}")
        ok &= p.check(finish_reasons(s.events) == [cw.get("finish_reason")],
                      f"{case}: streamed finish_reasons {finish_reasons(s.events)} vs {cw.get('finish_reason')!r}")
        su = usage_of(usage_events(s)[-1]) if usage_events(s) else {}
        ok &= p.check(su.get("completion_tokens") == usage_of(whole.json).get("completion_tokens"),
                      f"{case}: streamed usage {su} vs {usage_of(whole.json)}")
        equal += ok
    return p.outcome(f"{equal}/{len(cases(ctx))} streamed cases equal to the non-streamed answer", equal=equal)


def pick_stop(text: str) -> tuple[str, int] | None:
    """A 3-character printable stop string from the middle of ``text`` and where it first occurs (>= 1)."""
    for k in range(max(1, min(4, len(text) // 3)), len(text) - 3):
        s = text[k:k + 3]
        if s.isprintable() and "\ufffd" not in s and s.strip() == s:
            at = text.find(s)
            if at >= 1:
                return s, at
    return None


async def stop(ctx: Context, api: str) -> Outcome:
    n = max(ctx.lengths)
    base = await ctx.whole(api, 0, n)
    cb, why = first_choice(base, api)
    if cb is None:
        return Outcome("FAIL", f"greedy answer without stop: {why}")
    text = choice_text(cb, api)
    picked = pick_stop(text)
    if picked is None:
        return skipped(f"no 3-character printable stop string in the greedy text {text[:60]!r} (try larger --lengths)")
    s, at = picked
    want = text[:at]
    p = Problems()
    reply = await ctx.ep.post(PATHS[api], ctx.ep.body(api, ctx.prompts[0], n, stop=[s]))
    c, why = first_choice(reply, api)
    if p.check(c is not None, f"not streamed: {why}"):
        got = choice_text(c, api)
        p.check(got == want, f"not streamed: text {first_diff(got, want)}")
        p.check(s not in got, f"not streamed: the stop string {s!r} is in the output")
        p.check(c.get("finish_reason") == "stop", f"not streamed: finish_reason {c.get('finish_reason')!r}, not 'stop'")
    st = await ctx.ep.stream(PATHS[api], stream_body(ctx.ep, api, ctx.prompts[0], n, stop=[s]))
    bad = stream_problem(st)
    if p.check(not bad, f"streamed: {bad}"):
        got = joined_text(st.events, api)
        p.check(got == want, f"streamed: text {first_diff(got, want)}")
        p.check(finish_reasons(st.events) == ["stop"], f"streamed: finish_reasons {finish_reasons(st.events)}")
    return p.outcome(f"stop {s!r}: output ends before it ({len(want)} of {len(text)} chars), finish_reason 'stop', "
                     "streamed and not", stop=s, expected=want)


async def n_choices(ctx: Context, api: str) -> Outcome:
    p = Problems()
    prompt = ctx.prompts[0]
    reply = await ctx.ep.post(PATHS[api], ctx.ep.body(api, prompt, N_MAX_TOKENS, n=N_CHOICES, temperature=1.0))
    body = reply.json if isinstance(reply.json, dict) else {}
    if p.check(reply.status == 200, f"not streamed: {reply.short()}"):
        choices = [c for c in body.get("choices") or [] if isinstance(c, dict)]
        p.check(len(choices) == N_CHOICES, f"not streamed: {len(choices)} choices, not {N_CHOICES}")
        p.check(sorted((c.get("index") for c in choices), key=str) == list(range(N_CHOICES)),
                f"not streamed: indexes {[c.get('index') for c in choices]}")
        for c in choices:
            p.check(isinstance(choice_text(c, api), str), f"not streamed: choice {c.get('index')} has no text")
            p.check(bool(c.get("finish_reason")), f"not streamed: choice {c.get('index')} has no finish_reason")
        u = usage_of(body).get("completion_tokens")
        if all(c.get("finish_reason") == "length" for c in choices):
            p.check(u == N_CHOICES * N_MAX_TOKENS,
                    f"not streamed: completion_tokens {u}, not {N_CHOICES} x {N_MAX_TOKENS}")
        else:
            p.check(isinstance(u, int) and u <= N_CHOICES * N_MAX_TOKENS, f"not streamed: completion_tokens {u}")
    s = await ctx.ep.stream(PATHS[api], stream_body(ctx.ep, api, prompt, N_MAX_TOKENS, n=N_CHOICES, temperature=1.0,
                                                      **logprob_fields(api, 0)))
    bad = stream_problem(s)
    if p.check(not bad, f"streamed: {bad}"):
        entries = stream_choices(s.events)
        p.check({c.get("index") for c in entries} == set(range(N_CHOICES)),
                f"streamed: indexes {sorted({c.get('index') for c in entries}, key=str)}")
        tokens = 0
        for i in range(N_CHOICES):
            mine = [c for c in entries if c.get("index") == i]
            done = [k for k, c in enumerate(mine) if c.get("finish_reason")]
            p.check(len(done) == 1, f"streamed: choice {i} finished {len(done)} times")
            p.check(not done or done[0] == len(mine) - 1, f"streamed: choice {i} has events after its finish")
            tokens += sum(len(logprob_tokens(c, api) or []) for c in mine)
        su = usage_of(usage_events(s)[-1]) if usage_events(s) else {}
        p.check(su.get("completion_tokens") == tokens,
                f"streamed: usage.completion_tokens {su.get('completion_tokens')} vs {tokens} tokens streamed")
    return p.outcome(f"n={N_CHOICES}: {N_CHOICES} choices indexed 0..{N_CHOICES - 1}, each finished once, usage sums "
                     "them; streamed and not")


def _number_ok(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and value <= LOGPROB_EPS


async def logprobs(ctx: Context, api: str) -> Outcome:
    n = middle_length(ctx)
    p = Problems()
    plain = await ctx.whole(api, 0, n)
    reply = await ctx.ep.post(PATHS[api], ctx.ep.body(api, ctx.prompts[0], n, **logprob_fields(api, TOP_LOGPROBS)))
    c, why = first_choice(reply, api)
    cp, why_plain = first_choice(plain, api)
    if not p.check(c is not None, why) or not p.check(cp is not None, f"without logprobs: {why_plain}"):
        return p.outcome("")
    p.check(choice_text(c, api) == choice_text(cp, api),
            f"logprobs changed the greedy text: {first_diff(choice_text(c, api), choice_text(cp, api))}")
    lp = c.get("logprobs")
    if not p.check(isinstance(lp, dict), f"logprobs is {str(lp)[:100]}, not an object"):
        return p.outcome("")
    count = usage_of(reply.json).get("completion_tokens")
    if api == "completions":
        tokens, values, tops = lp.get("tokens") or [], lp.get("token_logprobs") or [], lp.get("top_logprobs") or []
        offsets = lp.get("text_offset")
        p.check(len(tokens) == len(values) == len(tops) == count,
                f"{len(tokens)} tokens, {len(values)} token_logprobs, {len(tops)} top_logprobs for "
                f"{count} completion_tokens")
        if offsets is not None:
            p.check(len(offsets) == len(tokens) and offsets == sorted(offsets), f"text_offset {offsets[:10]} not one "
                    "non-decreasing offset per token")
        alternatives = [list(t.values()) if isinstance(t, dict) else None for t in tops]
        counts_ok = all(a is not None and 1 <= len(a) <= TOP_LOGPROBS + 1 for a in alternatives)
        p.check(counts_ok, f"top_logprobs entries must be objects of 1..{TOP_LOGPROBS + 1} alternatives: "
                f"{[None if a is None else len(a) for a in alternatives][:10]}")
        if counts_ok and any(len(a) < TOP_LOGPROBS for a in alternatives):
            p.note("some tokens list fewer alternatives than asked (alternatives decoding to the same text merge)")
    else:
        content = lp.get("content") or []
        p.check(len(content) == count, f"{len(content)} logprobs.content entries for {count} completion_tokens")
        values = [e.get("logprob") if isinstance(e, dict) else None for e in content]
        alternatives = []
        for e in content:
            alts = e.get("top_logprobs") if isinstance(e, dict) else None
            ok = isinstance(alts, list) and all(isinstance(a, dict) and isinstance(a.get("token"), str) for a in alts)
            alternatives.append([a.get("logprob") for a in alts] if ok else None)
            p.check(isinstance(e, dict) and isinstance(e.get("token"), str), f"entry without a token: {str(e)[:80]}")
        p.check(all(a is not None and len(a) == TOP_LOGPROBS for a in alternatives),
                f"top_logprobs must list {TOP_LOGPROBS} alternatives per token: "
                f"{[None if a is None else len(a) for a in alternatives][:10]}")
    bad = [v for v in values if not _number_ok(v)] + [v for a in alternatives if a for v in a if not _number_ok(v)]
    p.check(not bad, f"logprobs not finite numbers <= 0: {bad[:5]}")
    if not bad:
        below = [k for k, (v, a) in enumerate(zip(values, alternatives)) if a and v < max(a) - ARGMAX_EPS]
        p.check(not below, f"greedy tokens {below[:5]} have a logprob below an alternative's (not the argmax)")
    return p.outcome(f"{count} tokens, each with a finite logprob <= 0 and its alternatives; greedy token is the "
                     "argmax; text unchanged")


async def usage(ctx: Context, api: str) -> Outcome:
    p = Problems()
    prompt_counts = []
    for n in sorted(set(ctx.lengths))[:2]:
        reply = await ctx.whole(api, 0, n)
        c, why = first_choice(reply, api)
        if not p.check(c is not None, f"max_tokens {n}: {why}"):
            continue
        u = usage_of(reply.json)
        pt, ct, tt = u.get("prompt_tokens"), u.get("completion_tokens"), u.get("total_tokens")
        if not p.check(all(isinstance(x, int) for x in (pt, ct, tt)), f"max_tokens {n}: usage {u}"):
            continue
        prompt_counts.append(pt)
        p.check(pt > 0, f"prompt_tokens {pt}")
        p.check(tt == pt + ct, f"max_tokens {n}: total_tokens {tt} != {pt} + {ct}")
        p.check(ct <= n, f"max_tokens {n}: completion_tokens {ct} > max_tokens")
        if c.get("finish_reason") == "length":
            p.check(ct == n, f"max_tokens {n}: finish_reason 'length' but completion_tokens {ct}")
    n = middle_length(ctx)
    s = await ctx.ep.stream(PATHS[api], stream_body(ctx.ep, api, ctx.prompts[0], n, **logprob_fields(api, 0)))
    bad = stream_problem(s)
    if p.check(not bad, f"stream with include_usage: {bad}"):
        found = usage_events(s)
        if p.check(len(found) == 1, f"stream with include_usage: {len(found)} usage events, not 1"):
            ev = found[0]
            u = ev["usage"]
            p.check(not ev.get("choices"), f"the usage event has choices {str(ev.get('choices'))[:80]}")
            last_choice = max((k for k, e in enumerate(s.events) if e.get("choices")), default=-1)
            p.check(s.events.index(ev) > last_choice, "the usage event comes before the last choice event")
            p.check(s.payloads[-1] == "[DONE]", "the stream does not end with [DONE] after the usage event")
            prompt_counts.append(u.get("prompt_tokens"))
            streamed = sum(len(logprob_tokens(c, api) or []) for c in stream_choices(s.events))
            p.check(u.get("completion_tokens") == streamed,
                    f"streamed usage.completion_tokens {u.get('completion_tokens')} vs {streamed} tokens streamed")
    plain = await ctx.ep.stream(PATHS[api], stream_body(ctx.ep, api, ctx.prompts[0], n, include_usage=False))
    bad = stream_problem(plain)
    if p.check(not bad, f"stream without include_usage: {bad}"):
        p.check(not usage_events(plain), "a stream without stream_options.include_usage carries usage")
    p.check(len(set(prompt_counts)) == 1, f"prompt_tokens differ between calls for one prompt: {prompt_counts}")
    return p.outcome(f"prompt_tokens {prompt_counts[0] if prompt_counts else '?'} in every call; totals add up; "
                     "streamed usage counts the streamed tokens, once, last", prompt_tokens=prompt_counts)


async def _tokenize(ep: Endpoint, text: str, special: bool) -> int | None:
    reply = await ep.post("/tokenize", {"model": ep.model, "prompt": text, "add_special_tokens": special})
    body = reply.json if isinstance(reply.json, dict) else {}
    if reply.status != 200:
        return None
    if isinstance(body.get("count"), int):
        return body["count"]
    return len(body["tokens"]) if isinstance(body.get("tokens"), list) else None


async def tokenize(ctx: Context) -> Outcome:
    probe = await ctx.ep.post("/tokenize", {"model": ctx.ep.model, "prompt": ctx.prompts[0]})
    if probe.status != 200:
        return skipped(f"no tokenizer endpoint (POST /tokenize: {probe.short()[:60]})")
    p, compared = Problems(), 0
    for prompt, n in cases(ctx):
        reply = await ctx.whole("completions", prompt, n)
        c, why = first_choice(reply, "completions")
        if not p.check(c is not None, why):
            continue
        u = usage_of(reply.json)
        count = await _tokenize(ctx.ep, ctx.prompts[prompt], True)
        p.check(count == u.get("prompt_tokens"),
                f"prompt {prompt}: /tokenize counts {count}, usage {u.get('prompt_tokens')}")
        text = c["text"]
        if "\ufffd" in text:
            continue
        count = await _tokenize(ctx.ep, text, False)
        compared += 1
        p.check(count == u.get("completion_tokens"),
                f"prompt {prompt} max_tokens {n}: the completion text tokenizes to {count}, usage says "
                f"{u.get('completion_tokens')}")
    return p.outcome(f"prompt_tokens and completion_tokens ({compared} texts) equal /tokenize's counts")


async def sse(ctx: Context, api: str) -> Outcome:
    n = middle_length(ctx)
    p = Problems()
    fields = logprob_fields(api, 1)
    whole = await ctx.ep.post(PATHS[api], ctx.ep.body(api, ctx.prompts[1], n, **fields))
    cw, why = first_choice(whole, api)
    if not p.check(cw is not None, f"not streamed: {why}"):
        return p.outcome("")
    s = await ctx.ep.stream(PATHS[api], stream_body(ctx.ep, api, ctx.prompts[1], n, **fields))
    if not p.check(s.status == 200 and not s.hung, f"stream: {s.short()}"):
        return p.outcome("")
    p.check(s.content_type.startswith("text/event-stream"), f"Content-Type {s.content_type!r}")
    p.check(not s.error, s.error)
    odd = [ln for ln in s.lines if not ln.startswith(("data:", ":"))]
    p.check(not odd, f"lines that are not data: lines: {odd[:3]}")
    p.check(not s.bad_json, f"payloads that are not JSON objects: {s.bad_json[:3]}")
    p.check(s.done_count == 1, f"data: [DONE] came {s.done_count} times")
    p.check(not s.after_done, f"lines after [DONE]: {s.after_done[:3]}")
    p.check(bool(s.payloads) and s.payloads[-1] == "[DONE]", "the last event is not data: [DONE]")
    p.check(not s.error_events(), f"error events: {s.error_events()[:1]}")
    ids = {e.get("id") for e in s.events}
    p.check(len(ids) == 1 and isinstance(next(iter(ids), None), str), f"event ids {sorted(map(str, ids))[:4]}")
    want_object = OBJECTS[api][1]
    objects = {e.get("object") for e in s.events}
    p.check(objects == {want_object}, f"objects {sorted(map(str, objects))}, not {want_object!r}")
    p.check(all(isinstance(e.get("created"), int) and isinstance(e.get("model"), str) for e in s.events),
            "an event without created or model")
    entries = [c for c in stream_choices(s.events) if c.get("index", 0) == 0]
    per_event = [len(logprob_tokens(c, api) or []) for c in entries]
    p.check(all(k <= 1 for k in per_event), f"events carrying several tokens: {[k for k in per_event if k > 1][:5]}")
    streamed = [t for c in entries for t in (logprob_tokens(c, api) or [])]
    want_tokens = logprob_tokens(cw, api) or []
    count = usage_of(whole.json).get("completion_tokens")
    p.check(sum(1 for k in per_event if k) == count, f"{sum(1 for k in per_event if k)} token events for "
            f"{count} completion_tokens")
    p.check(streamed == want_tokens, f"streamed tokens {streamed[:8]} differ from the answer's {want_tokens[:8]} "
            "(order or content)")
    p.check(joined_text(s.events, api) == choice_text(cw, api),
            f"streamed text {first_diff(joined_text(s.events, api), choice_text(cw, api))}")
    done = [k for k, c in enumerate(entries) if c.get("finish_reason")]
    p.check(done == [len(entries) - 1], f"finish_reason in events {done} of {len(entries)}, not only the last")
    if api == "chat" and entries:
        p.check((entries[0].get("delta") or {}).get("role") == "assistant",
                "the first chat event has no role 'assistant'")
        roles = {(c.get("delta") or {}).get("role") for c in entries[1:]} - {None, "assistant"}
        p.check(not roles, f"other roles in the deltas: {roles}")
    return p.outcome(f"{len(s.payloads)} events: one per token ({count}) in order, same id, valid JSON, "
                     "exactly one [DONE] at the end")
