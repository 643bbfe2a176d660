"""``pdserve bench conformance``'s run: endpoints from the flags, the checks, the table, the JSON.

Reading path: ``__init__.py`` (flags, help), this file (one run), ``runner.py`` (the checks in
order, the guards), the areas (``correctness.py``, ``sdk.py``, ``bad_input.py``,
``cancellation.py``, ``faults.py``), ``wire.py`` (bounded HTTP and SSE), ``verdict.py`` and
``report.py`` (verdicts, table, JSON).
"""

from __future__ import annotations

import asyncio
import datetime
import sys

from .report import format_markdown, format_table, write_json
from .runner import Context, listed_model, run_all
from .verdict import exit_status
from .wire import Endpoint


def _endpoint(args, url: str) -> Endpoint:
    return Endpoint(url, api_key=args.api_key, ignore_eos=args.ignore_eos, hang_s=args.hang_s,
                    total_s=args.request_timeout)


async def _connect(args, ctx: Context) -> None:
    await ctx.ep.open()
    ctx.ep.model, listed_len = await listed_model(ctx.ep, args.model)
    ctx.max_model_len = args.max_model_len or listed_len
    if ctx.ref is not None:
        await ctx.ref.open()
        ctx.ref.model, _ = await listed_model(ctx.ref, args.reference_model)


async def _run(args, ctx: Context, areas) -> list:
    def say(result, i: int, n: int) -> None:
        if not args.quiet:
            print(f"[{i}/{n}] {result.verdict} {result.name} ({result.seconds:.1f}s): {result.detail[:160]}",
                  file=sys.stderr, flush=True)

    try:
        try:
            await _connect(args, ctx)
        except (RuntimeError, OSError) as e:
            raise ConnectionError(str(e)) from None
        return await run_all(ctx, areas, args.check_timeout, say)
    finally:
        await ctx.ep.close()
        if ctx.ref is not None:
            await ctx.ref.close()


def run_suite(args, areas: tuple[str, ...], lengths: tuple[int, ...], kills: list[tuple[str, str]]) -> int:
    try:
        ep = _endpoint(args, args.url)
        ref = _endpoint(args, args.reference_url) if args.reference_url else None
    except ValueError as e:
        print(f"pdserve bench conformance: error: {e}", file=sys.stderr)
        return 2
    ctx = Context(ep, ref, lengths=lengths, metrics_urls=args.metrics_url or [ep.url + "/metrics"], kill_cmds=kills,
                  options={"cancel_max_tokens": args.cancel_max_tokens, "fault_streams": args.fault_streams,
                           "fault_max_tokens": args.fault_max_tokens, "fault_after_tokens": args.fault_after_tokens,
                           "kill_timeout": args.kill_timeout, "recover_timeout": args.recover_timeout})
    started = datetime.datetime.now(datetime.timezone.utc)
    try:
        results = asyncio.run(_run(args, ctx, areas))
    except ConnectionError as e:
        print(f"pdserve bench conformance: cannot use {args.url}: {e}", file=sys.stderr)
        return 2
    table = format_table(results)
    if args.markdown:
        table = format_markdown(results) + "\n\n" + table.splitlines()[-1]  # and the count line
    print(f"conformance of {ep.url} (model {ep.model!r})"
          + (f" against the reference {ref.url} (model {ref.model!r})" if ref else " (no reference endpoint)"))
    print(table)
    if args.json is not None:
        config = {"url": ep.url, "reference_url": ref.url if ref else None, "model": ep.model,
                  "reference_model": ref.model if ref else None, "max_model_len": ctx.max_model_len,
                  "areas": list(areas), "lengths": list(lengths), "kill_cmds": [list(k) for k in kills],
                  "metrics_urls": ctx.metrics_urls, "ignore_eos": args.ignore_eos, "hang_s": args.hang_s,
                  "request_timeout": args.request_timeout, "started": started.isoformat(timespec="seconds"),
                  **ctx.options}
        print(f"wrote {write_json(args.json, results, config)}")
    return exit_status(results)
