"""The run: find the model, build the checks of the chosen areas, run them one after another.

1. **connect**: ``GET /v1/models`` of --url (and of --reference-url): the model to use is
   --model or the first listed; the context length is the listing's ``max_model_len``
   (vLLM and pdserve list it) or --max-model-len. An endpoint that does not answer at all
   ends the run with status 2 before any check.
2. **checks**: each area module (correctness, sdk, bad_input, cancellation, faults) gives
   its ``Check``s for this run; they run one at a time, in that order (faults last: they
   disturb the server), so no check's load blurs another's reading of the server.
3. **guard**: a check runs under ``--check-timeout``; past it, or when it raises, it FAILs
   with the reason (``verdict.py``); the run always goes on to the next check.

``Context`` is what the checks share: both endpoints, the prompts and lengths, and a memo
of greedy whole answers so checks that need the same reference text ask for it once.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from .verdict import FAIL, SKIP, Outcome, Result
from .wire import PATHS, Endpoint, Reply

AREAS = ("correctness", "client", "bad-input", "cancellation", "faults")

# Greedy prompts: short, medium and a long one (about 400 characters), plain English so any
# tokenizer has ordinary tokens to work with.
PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "In the early morning the harbour was quiet. Fishing boats rocked gently against the pier, their "
    "ropes creaking, while gulls circled overhead looking for scraps. An old man sat on an upturned "
    "crate, mending a net with slow, practised hands. He had done this every day for forty years, and "
    "he knew every knot by touch. A girl walked along the pier towards him, carrying a letter.",
)


@dataclass(slots=True)
class Check:
    name: str
    area: str
    run: Callable[["Context"], Awaitable[Outcome]]


@dataclass(slots=True)
class Context:
    ep: Endpoint
    ref: Endpoint | None = None
    lengths: tuple[int, ...] = (1, 16, 64)
    prompts: tuple[str, ...] = PROMPTS
    max_model_len: int | None = None
    metrics_urls: list[str] = field(default_factory=list)
    kill_cmds: list[tuple[str, str]] = field(default_factory=list)
    options: dict = field(default_factory=dict)   # the area-specific knobs of the command line
    memo: dict = field(default_factory=dict)

    async def whole(self, api: str, prompt: int, max_tokens: int, which: str = "url") -> Reply:
        """The greedy non-streamed answer of one case, asked once per run: ``which`` is "url",
        "ref" (the reference endpoint) or "repeat" (--url again, a second, separate request)."""
        key = (which, api, prompt, max_tokens)
        if key not in self.memo:
            ep = self.ref if which == "ref" else self.ep
            self.memo[key] = await ep.post(PATHS[api], ep.body(api, self.prompts[prompt], max_tokens))
        return self.memo[key]

    def option(self, name: str, default=None):
        return self.options.get(name, default)


async def run_check(ctx: Context, check: Check, timeout_s: float) -> Result:
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            outcome = await check.run(ctx)
    except TimeoutError:
        outcome = Outcome(FAIL, f"hang guard: the check did not end within {timeout_s:g}s (--check-timeout)")
    except Exception as e:  # noqa: BLE001 - a check that raises fails; the run goes on
        outcome = Outcome(FAIL, f"the check raised {type(e).__name__}: {e}",
                          {"traceback": traceback.format_exc(limit=6)})
    return Result(check.name, check.area, outcome.verdict, outcome.detail, time.monotonic() - t0, outcome.data)


def build_checks(ctx: Context, areas: tuple[str, ...]) -> list[Check]:
    from . import bad_input, cancellation, correctness, faults, sdk

    makers = {"correctness": correctness.checks, "client": sdk.checks, "bad-input": bad_input.checks,
              "cancellation": cancellation.checks, "faults": faults.checks}
    out: list[Check] = []
    for area in AREAS:
        if area in areas:
            out += makers[area](ctx)
        else:
            out.append(Check(f"{area}.*", area, _skip(f"area left out (--areas {','.join(areas)})")))
    return out


def _skip(why: str):
    async def run(ctx: Context) -> Outcome:
        return Outcome(SKIP, why)
    return run


async def listed_model(ep: Endpoint, wanted: str | None) -> tuple[str, int | None]:
    """(model, max_model_len or None) from ``GET /v1/models``; RuntimeError when it cannot be read."""
    reply = await ep.get("/v1/models")
    data = reply.json.get("data") if isinstance(reply.json, dict) else None
    if reply.status != 200 or not isinstance(data, list):
        if wanted:
            return wanted, None  # no listing, but we were told the name
        raise RuntimeError(f"{ep.url}/v1/models: {reply.short()}; pass --model to go on without it")
    ids = [m.get("id") for m in data if isinstance(m, dict)]
    model = wanted or (ids[0] if ids else None)
    if not model:
        raise RuntimeError(f"{ep.url}/v1/models lists no model; pass --model")
    entry = next((m for m in data if isinstance(m, dict) and m.get("id") == model), {})
    length = entry.get("max_model_len")
    return model, length if isinstance(length, int) and length > 0 else None


async def run_all(ctx: Context, areas: tuple[str, ...], check_timeout_s: float,
                  on_result: Callable[[Result, int, int], None] = lambda r, i, n: None) -> list[Result]:
    checks = build_checks(ctx, areas)
    results = []
    for i, check in enumerate(checks):
        result = await run_check(ctx, check, check_timeout_s)
        results.append(result)
        on_result(result, i + 1, len(checks))
    return results
