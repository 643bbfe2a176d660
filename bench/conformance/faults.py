"""Faults: a server process killed under streaming load (only with ``--kill-cmd ROLE=CMD``).

Per role, in the order given (``faults.kill-<role>``):

1. **reference**: the greedy text of each of ``--fault-streams`` prompts at
   ``--fault-max-tokens``, from --reference-url when given, else from --url before any kill.
2. **load**: that many greedy streams at once on --url.
3. **kill**: once every stream still open has produced ``--fault-after-tokens`` tokens (the
   trigger is the streams' progress, never a sleep), CMD runs in a shell (bounded by
   ``--kill-timeout``; a non-zero exit fails the check: the fault did not happen as asked).
   At least one stream must still be open when CMD returns, or nothing was tested.
4. **outcomes**: every stream ends (each bounded by the hang guard) as one of
   ``completed`` (finish_reason and ``[DONE]``; its text must equal the reference, else
   ``wrong``), ``error-event`` (an SSE ``error`` event: the server said why), ``http-error``
   (a 4xx/5xx status, or the connection refused: the server was gone before answering),
   ``broken`` (the connection broke mid-body: the process serving it died; the only signal
   when the front door itself is killed), ``cut`` (the body ended cleanly without ``[DONE]``
   and without an error event: the client cannot tell a failure from an answer), ``hung``
   (no byte for --hang-s, or not done within --request-timeout).

The check passes when none is hung, cut or wrong: a stream may fail under a fault, but
it must say so (or visibly break) and must never hang or lie. The counts are the report.

``faults.recover-<role>`` then sends a short greedy request until one is served with the
reference text, within ``--recover-timeout`` (0: skip; a server that nothing restarts
never recovers, and that is the operator's answer, not a protocol bug).

With pdserve's local cluster, ``pdserve up --log-dir DIR`` writes ``DIR/<server>.pid``, e.g.
``--kill-cmd decode='kill -9 $(cat DIR/decode-0.pid)'``.
"""

from __future__ import annotations

import asyncio
import time

from .correctness import first_choice
from .runner import Check, Context
from .verdict import Outcome, Problems, skipped
from .wire import COMPLETIONS, StreamReply, choice_text, finish_reasons, joined_text

OUTCOMES = ("completed", "error-event", "http-error", "broken", "cut", "hung", "wrong")
BAD = ("cut", "hung", "wrong")
RECOVER_MAX_TOKENS = 8
RECOVER_PAUSE_S = 1.0


def checks(ctx: Context) -> list[Check]:
    if not ctx.kill_cmds:
        async def none(c: Context) -> Outcome:
            return skipped("no --kill-cmd ROLE=CMD given")
        return [Check("faults.*", "faults", none)]
    out = []
    for role, cmd in ctx.kill_cmds:
        out.append(Check(f"faults.kill-{role}", "faults", lambda c, r=role, k=cmd: kill_under_load(c, r, k)))
        out.append(Check(f"faults.recover-{role}", "faults", lambda c, r=role: recover(c, r)))
    return out


def fault_prompts(ctx: Context) -> list[str]:
    k = ctx.option("fault_streams", 4)
    return [f"{ctx.prompts[i % len(ctx.prompts)]} ({i})" for i in range(k)]


def fault_max_tokens(ctx: Context) -> int:
    n = ctx.option("fault_max_tokens", 256)
    if ctx.max_model_len:
        n = min(n, ctx.max_model_len - 256)
    return max(n, 8)


def classify(s: StreamReply, reference: str | None) -> str:
    """One stream's outcome under a fault (see the module docstring)."""
    if s.hung:
        return "hung"
    if s.status != 200:
        return "http-error"
    if s.error_events():
        return "error-event"
    if s.error:
        return "broken"
    if s.done_count == 1 and finish_reasons(s.events):
        return "wrong" if reference is not None and joined_text(s.events, "completions") != reference else "completed"
    return "cut"


def why(s: StreamReply) -> str:
    if s.error_events():
        err = s.error_events()[0].get("error")
        return str(err.get("message") if isinstance(err, dict) else err)[:120]
    return s.short()[:120]


async def references(ctx: Context, prompts: list[str], max_tokens: int) -> tuple[list[str | None], str]:
    ep = ctx.ref or ctx.ep
    replies = await asyncio.gather(*(ep.post(COMPLETIONS, ep.body("completions", p, max_tokens)) for p in prompts))
    texts, bad = [], ""
    for i, reply in enumerate(replies):
        c, problem = first_choice(reply, "completions")
        texts.append(choice_text(c, "completions") if c else None)
        bad = bad or (f"prompt {i}: {problem}" if c is None else "")
    return texts, bad


async def run_kill(cmd: str, timeout_s: float) -> tuple[int | None, str]:
    """(exit status or None when it ran past timeout_s, its output)."""
    proc = await asyncio.create_subprocess_shell(cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        async with asyncio.timeout(timeout_s):
            out, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return None, ""
    return proc.returncode, out.decode("utf-8", "replace").strip()[-300:]


async def kill_under_load(ctx: Context, role: str, cmd: str) -> Outcome:
    p = Problems()
    prompts, n = fault_prompts(ctx), fault_max_tokens(ctx)
    after = ctx.option("fault_after_tokens", 8)
    reference, bad = await references(ctx, prompts, n)
    (ctx.memo[("recover", role)],), bad_recover = await references(ctx, prompts[:1], RECOVER_MAX_TOKENS)
    if bad or bad_recover:
        return Outcome("FAIL", f"reference pass before the kill failed ({bad or bad_recover}); nothing was killed")
    progress, done = [0] * len(prompts), [False] * len(prompts)
    trigger = asyncio.Event()

    def ready() -> None:
        if all(d or k >= after for k, d in zip(progress, done)):
            trigger.set()

    def counter(i: int):
        def on_event(event: dict) -> bool:
            progress[i] += sum(1 for c in event.get("choices") or [] if c.get("finish_reason") is None)
            ready()
            return False
        return on_event

    async def one(i: int) -> StreamReply:
        try:
            return await ctx.ep.stream(COMPLETIONS, ctx.ep.body("completions", prompts[i], n, stream=True),
                                       stop=counter(i))
        finally:
            done[i] = True
            ready()

    t0 = time.monotonic()
    tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
    try:
        try:
            async with asyncio.timeout(ctx.ep.hang_s):
                await trigger.wait()
        except TimeoutError:
            p.add(f"the streams did not reach {after} tokens each within {ctx.ep.hang_s:g}s: {progress}")
        open_at_kill = open_after = sum(not d for d in done)
        rc, output, kill_at = None, "", None
        if trigger.is_set():
            kill_at = round(time.monotonic() - t0, 3)
            rc, output = await run_kill(cmd, ctx.option("kill_timeout", 60.0))
            open_after = sum(not d for d in done)
            p.check(rc == 0, f"the kill command exited with {rc if rc is not None else 'a timeout'}: {output[:160]}")
            p.check(open_after > 0, f"every stream had ended before the kill command returned ({progress} tokens): "
                    f"raise --fault-max-tokens")
        streams = await asyncio.gather(*tasks)
    finally:  # the check's own guard cancelled us: no stream outlives the check
        for task in tasks:
            task.cancel()
    outcomes = [classify(s, ref) for s, ref in zip(streams, reference)]
    counts = {o: outcomes.count(o) for o in OUTCOMES}
    for i, (o, s) in enumerate(zip(outcomes, streams)):
        if o in BAD:
            p.add(f"stream {i} {o}: {why(s)}")
    errors = sorted({why(s) for o, s in zip(outcomes, streams) if o in ("error-event", "http-error", "broken")})
    shown = ", ".join(f"{k} {v}" for k, v in counts.items())
    detail = (f"{len(streams)} streams: {shown}; kill ({role}) exit {rc} once every open stream had >= {after} of {n} "
              f"tokens ({open_at_kill} open, {open_after} still open after it)"
              + (f"; errors: {errors[:2]}" if errors else ""))
    data = {"counts": counts, "kill_exit": rc, "kill_output": output, "open_at_kill": open_at_kill,
            "open_after_kill": open_after, "kill_at_s": kill_at, "errors": errors,
            "streams": [{"outcome": o, "tokens": k, "error": why(s) if o != "completed" else "",
                         "seconds": round(s.seconds, 3), "longest_silence": round(s.longest_silence, 3)}
                        for o, k, s in zip(outcomes, progress, streams)]}
    out = p.outcome(detail, **data)
    if out.verdict == "FAIL":
        out.detail = f"{shown}: " + out.detail
    return out


async def recover(ctx: Context, role: str) -> Outcome:
    limit = ctx.option("recover_timeout", 180.0)
    if not limit:
        return skipped("--recover-timeout 0")
    prompt = fault_prompts(ctx)[0]
    want = ctx.memo.get(("recover", role))  # computed before the kill
    t0, attempts, last = time.monotonic(), 0, ""
    while time.monotonic() - t0 < limit:
        attempts += 1
        reply = await ctx.ep.post(COMPLETIONS, ctx.ep.body("completions", prompt, RECOVER_MAX_TOKENS))
        c, last = first_choice(reply, "completions")
        if c is not None:
            text = choice_text(c, "completions")
            if want is not None and text != want:
                return Outcome("FAIL", f"served again after {time.monotonic() - t0:.1f}s but the greedy text "
                               f"{text!r} differs from the reference {want!r}")
            return Outcome("PASS", f"serving again {time.monotonic() - t0:.1f}s after the kill round "
                           f"({attempts} attempts), reference text")
        await asyncio.sleep(RECOVER_PAUSE_S)
    return Outcome("FAIL", f"not serving {limit:g}s after the kill of {role} ({attempts} attempts; last: {last[:120]})")
