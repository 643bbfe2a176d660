"""Cancellation: a client that walks away must cost the server nothing lasting.

- ``cancel.stream.<api>``: a long greedy stream (``--cancel-max-tokens``) is closed by the
  client once it has produced a few tokens;
- ``cancel.whole``: a long non-streamed request whose connection the client closes while
  the server works on it (once the server's counters show it in flight, where it has them;
  else at once after sending it).

After each: where the server exposes in-flight counters (``/metrics`` of --url, or the
``--metrics-url`` pages: vLLM's ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``,
pdserve's ``pdserve_requests_running`` / ``_waiting`` / ``_queued``, SGLang's
``sglang:num_running_reqs`` / ``sglang:num_queue_reqs``), they must come back to what they read
before the request, within the hang guard: work left running for a client that is gone holds
batch slots and KV blocks. A server without such counters passes on the rest (the detail says
the counters were not checked). Then the next request must be served, with the same greedy
text as before the cancellation: the server stays healthy.

The counters cannot tell a cancelled generation from one that finished by itself; the long
``max_tokens`` makes the difference large, and the detail reports how long the counters took
to come back. With pdserve, pass the decode servers' /metrics with --metrics-url to see the
cancellation reach the decodes.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from urllib.parse import urlsplit

from .correctness import first_choice
from .runner import Check, Context
from .verdict import Outcome, Problems
from .wire import PATHS, choice_text

IN_FLIGHT_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "pdserve_requests_running",
                    "pdserve_requests_waiting", "pdserve_requests_queued", "sglang:num_running_reqs",
                    "sglang:num_queue_reqs")
CANCEL_AFTER_TOKENS = 3
POLL_S = 0.1


def checks(ctx: Context) -> list[Check]:
    return [Check("cancel.stream.completions", "cancellation", lambda c: cancel_stream(c, "completions")),
            Check("cancel.stream.chat", "cancellation", lambda c: cancel_stream(c, "chat")),
            Check("cancel.whole", "cancellation", cancel_whole)]


def parse_in_flight(text: str) -> dict[str, float]:
    """The in-flight gauges of one /metrics page, summed over label sets ({} when it has none)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in IN_FLIGHT_GAUGES:
                    out[sample.name] = out.get(sample.name, 0.0) + sample.value
    except ValueError:
        return {}
    return out


async def read_in_flight(ctx: Context) -> dict[str, dict[str, float]]:
    """url -> its in-flight gauges, for every metrics page that has some."""
    out = {}
    for url in ctx.metrics_urls:
        try:
            async with asyncio.timeout(ctx.ep.hang_s):
                async with ctx.ep.session.get(url) as resp:
                    text = await resp.text() if resp.status == 200 else ""
        except Exception:  # noqa: BLE001 - no page there: no counters from it
            continue
        gauges = parse_in_flight(text)
        if gauges:
            out[url] = gauges
    return out


def total(readings: dict[str, dict[str, float]]) -> float:
    return sum(v for gauges in readings.values() for v in gauges.values())


def cancel_max_tokens(ctx: Context) -> int:
    wanted = ctx.option("cancel_max_tokens") or 1024
    if ctx.max_model_len:
        wanted = min(wanted, ctx.max_model_len - 256)
    return max(wanted, 16)


async def settle(ctx: Context, p: Problems, before: dict) -> str:
    """Wait until the counters are back to ``before``; a sentence for the detail."""
    if not before:
        p.note("no in-flight counters at " + ", ".join(ctx.metrics_urls) + ": not checked")
        return "in-flight counters: none exposed"
    t0 = time.monotonic()
    base = total(before)
    while True:
        now = await read_in_flight(ctx)
        if set(now) >= set(before) and total(now) <= base:  # every page read again, none left out
            return (f"in-flight counters of {len(now)} /metrics page{'s' if len(now) > 1 else ''} back to {base:g} "
                    f"{time.monotonic() - t0:.1f}s after the close")
        if time.monotonic() - t0 > ctx.ep.hang_s:
            p.add(f"in-flight counters still {now} {ctx.ep.hang_s:g}s after the client left (before: {before})")
            return ""
        await asyncio.sleep(POLL_S)


async def next_request_served(ctx: Context, p: Problems, api: str, before) -> None:
    """``before``: the same request's answer from before the cancellation (``ctx.whole``)."""
    n = min(ctx.lengths)
    reply = await ctx.ep.post(PATHS[api], ctx.ep.body(api, ctx.prompts[0], n))
    c, why = first_choice(reply, api)
    if p.check(c is not None, f"the next request was not served: {why}"):
        cb, _ = first_choice(before, api)
        p.check(cb is None or choice_text(c, api) == choice_text(cb, api),
                "the next request's greedy text differs from the same request's before the cancellation")


async def cancel_stream(ctx: Context, api: str) -> Outcome:
    p = Problems()
    answer = await ctx.whole(api, 0, min(ctx.lengths))
    before = await read_in_flight(ctx)
    n = cancel_max_tokens(ctx)
    seen = {"tokens": 0}

    def enough(event: dict) -> bool:
        for c in event.get("choices") or []:
            if c.get("finish_reason") is None and choice_text(c, api) is not None:
                seen["tokens"] += 1
        return seen["tokens"] >= CANCEL_AFTER_TOKENS

    s = await ctx.ep.stream(PATHS[api], ctx.ep.body(api, ctx.prompts[1], n, stream=True), stop=enough)
    if not p.check(s.status == 200, f"the stream: {s.short()}"):
        return p.outcome("")
    p.check(s.closed_by_client,
            f"the stream ended before {CANCEL_AFTER_TOKENS} tokens ({s.short()}): nothing to cancel")
    settled = await settle(ctx, p, before)
    await next_request_served(ctx, p, api, answer)
    return p.outcome(f"closed after {seen['tokens']} of {n} tokens; {settled}; next request served, same text")


def _raw_request(ctx: Context, api: str, max_tokens: int) -> tuple[str, int, bool, bytes]:
    parts = urlsplit(ctx.ep.url)
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    body = json.dumps(ctx.ep.body(api, ctx.prompts[1], max_tokens)).encode()
    head = [f"POST {parts.path}{PATHS[api]} HTTP/1.1", f"Host: {parts.netloc}", "Content-Type: application/json",
            f"Content-Length: {len(body)}", "Connection: close"]
    if ctx.ep.api_key:
        head.append(f"Authorization: Bearer {ctx.ep.api_key}")
    return parts.hostname, port, tls, ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def cancel_whole(ctx: Context) -> Outcome:
    p = Problems()
    answer = await ctx.whole("completions", 0, min(ctx.lengths))
    before = await read_in_flight(ctx)
    n = cancel_max_tokens(ctx)
    host, port, tls, raw = _raw_request(ctx, "completions", n)
    how = "at once after sending it (no counters to see it start)"
    async with asyncio.timeout(ctx.ep.hang_s):
        reader, writer = await asyncio.open_connection(host, port, ssl=ssl.create_default_context() if tls else None)
    try:
        writer.write(raw)
        await writer.drain()
        if before:
            t0 = time.monotonic()
            while time.monotonic() - t0 < ctx.ep.hang_s:
                now = await read_in_flight(ctx)
                if total(now) > total(before):
                    how = "once the counters showed it in flight"
                    break
                if reader.at_eof():
                    break
                await asyncio.sleep(POLL_S)
            else:
                p.note("the counters never showed the request in flight")
            if reader.at_eof():
                p.note("the server answered before the client left (raise --cancel-max-tokens)")
    finally:
        writer.close()
        try:
            async with asyncio.timeout(5):
                await writer.wait_closed()
        except (OSError, TimeoutError):
            pass
    settled = await settle(ctx, p, before)
    await next_request_served(ctx, p, "completions", answer)
    return p.outcome(f"closed a {n}-token request {how}; {settled}; next request served, same text")
