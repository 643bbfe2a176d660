"""The router's target rate: the requests/s that 64 prefills of a profile sustain on the conversation trace.

A prefill's busy time for one request is its prompt's prefill on the profile's step model
(``engine/sim/profile.py``): ``prefill_token_s * new + prefill_pair_s * new * (cached + (new + 1) / 2)``
plus its share of the steps' fixed cost, ``base_s * new / step_tokens`` (chunks of ``step_tokens`` tokens
from several requests share a step). ``new`` is what the prompt does not find cached:

- ``reuse``: every leading 512-token block (the trace's hash ids) that an earlier request of the trace
  already had is cached (an unbounded cache, routed perfectly): the most requests/s, the stricter target;
- ``no reuse``: every prompt token computed.

64 prefills sustain ``64 / mean(busy time)`` requests/s. Decode is not a prefill's work in P/D, so it is
not counted. The profile was fitted on prompts up to 2048 tokens (its ``fit``); the trace's longer prompts
(mean ~12k, max 126k tokens) extrapolate it, and the quadratic term dominates them.
"""

from __future__ import annotations

from pathlib import Path

from pdserve.bench.trace_replay import TRACE_BLOCK_TOKENS, read_trace
from pdserve.engine.sim.profile import load_profile


def prefills_rate(trace: Path, profile: str = "h200-llama3-8b", prefills: int = 64, step_tokens: int = 8192) -> dict:
    prof = load_profile(profile)
    st = prof.step
    reqs = read_trace(trace, "mooncake")
    seen: set[int] = set()
    busy = {"reuse": 0.0, "no_reuse": 0.0}
    tokens = {"input": 0, "cached": 0, "output": 0}
    for r in reqs:
        hit = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            hit += 1
        seen.update(r.hash_ids)
        # the engine never reuses the block of the last token
        cached = min(hit * TRACE_BLOCK_TOKENS, max(0, r.input_length - 1))
        tokens["input"] += r.input_length
        tokens["output"] += r.output_length
        tokens["cached"] += cached
        for case, c in (("reuse", cached), ("no_reuse", 0)):
            new = r.input_length - c
            busy[case] += (st.prefill_token_s * new + st.prefill_pair_s * new * (c + (new + 1) / 2)
                           + st.base_s * new / step_tokens)
    n = len(reqs)
    span = reqs[-1].time_s - reqs[0].time_s
    out = {"profile": prof.name, "prefills": prefills, "step_tokens": step_tokens, "requests": n,
           "trace_rate_per_s": n / span if span > 0 else None,
           "mean_input_tokens": tokens["input"] / n, "mean_cached_tokens_reuse": tokens["cached"] / n,
           "mean_output_tokens": tokens["output"] / n,
           "step": {"base_s": st.base_s, "prefill_token_s": st.prefill_token_s, "prefill_pair_s": st.prefill_pair_s}}
    for case, total in busy.items():
        mean = total / n
        out[case] = {"mean_busy_s": mean, "per_prefill_per_s": 1 / mean, "rate_per_s": prefills / mean}
    out["target_per_s"] = max(out["reuse"]["rate_per_s"], out["no_reuse"]["rate_per_s"])
    return out


def describe(t: dict) -> str:
    r, nr = t["reuse"], t["no_reuse"]
    return (f"{t['prefills']} x {t['profile']} on the conversation trace ({t['requests']} requests, mean prompt "
            f"{t['mean_input_tokens']:.0f} tokens, {t['mean_cached_tokens_reuse']:.0f} of them cached with reuse): "
            f"busy {r['mean_busy_s'] * 1e3:.0f} ms/request with reuse -> {r['rate_per_s']:.0f} req/s; "
            f"{nr['mean_busy_s'] * 1e3:.0f} ms without -> {nr['rate_per_s']:.0f} req/s "
            f"(the trace itself: {t['trace_rate_per_s']:.1f} req/s)")
