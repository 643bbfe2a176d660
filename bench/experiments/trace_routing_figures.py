"""The trace-routing experiment's figures: arm order, one run's figures, medians, ratios and verdicts.

Pure (no servers, no sockets), unit-tested in tests/unit/test_trace_routing_figures.py.

- ``arm_order``: the runs, arms alternating round by round (A B C A B C): drift of the box over the
  experiment falls on every arm alike.
- ``run_figures``: one run's figures from the client's results (``loadgen_report.summarize``: TTFT,
  TPOT, failures, and goodput, DistServe's measure: requests per second meeting both the TTFT and the
  mean time-between-tokens target) and the servers' counters (flat ``role:name`` keys, ``counter_keys``):
  prompt tokens the prefills computed, KV moved prefill -> decode, decode-side prefix hits, and the
  cache hit rates that explain them (each prefill's, the router's index, the decodes').
- ``summarize_arms``: each arm's medians over its runs; ``ratios``: each arm's medians over the baseline's;
  ``pair_ratios``: the same per round (arm and baseline of one round), so a verdict can say whether it
  rests on pairs that fall on both sides of its target (``verdict``).
"""

from __future__ import annotations

import statistics

from pdserve.bench.loadgen_report import RequestResult, summarize

BASELINE = "round-robin"
# key of run_figures -> (issue 33's target for prefix-aware routing over round robin, "lower" or "higher" is better)
TARGETS = {"ttft_p99_ms": (0.5, "lower"), "prefill_tokens_computed": (0.6, "lower"), "goodput_rps": (1.3, "higher")}
# the scalar figures medians and ratios are taken of
SCALARS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "goodput_rps", "slo_attained", "failed",
           "prompt_tokens", "prefill_tokens_computed", "kv_bytes_moved", "decode_prefix_hit_tokens",
           "prefill_hit_rate", "router_hit_rate", "decode_hit_rate")
# counter keys (role:name) -> Prometheus sample summed: prefills and decodes
PREFILL_COUNTERS = {"prompt_tokens": "pdserve_prompt_tokens_total",
                    "hit_tokens": "pdserve_prefix_cache_hit_tokens_total",
                    "computed_tokens": "pdserve_prompt_tokens_computed_total",
                    "kv_bytes": "pdserve_kv_transfer_bytes_total"}
DECODE_COUNTERS = {"hit_tokens": "pdserve_prefix_cache_hit_tokens_total"}
DECODE_BLOCK_SOURCES = ("reused", "moved", "computed")  # pdserve_kv_prompt_blocks_total{source}
ROUTER_COUNTERS = {"prompt_blocks": "pdserve_router_prompt_blocks_total",
                   "hit_blocks": "pdserve_router_prefix_hit_blocks_total"}


def arm_order(arms: list[str], repeats: int) -> list[tuple[int, str]]:
    """(round, arm) of every run: all arms in round 0, then all in round 1, ..."""
    if not arms or len(set(arms)) != len(arms):
        raise ValueError(f"arms must be distinct and at least one, got {arms}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    return [(r, arm) for r in range(repeats) for arm in arms]


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _total(counters: dict[str, float], role: str, name: str) -> float:
    return sum(v for k, v in counters.items() if k.startswith(role) and k.endswith(":" + name))


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def run_figures(results: list[RequestResult], wall_s: float, counters: dict[str, float], slo_ttft_s: float,
                slo_tbt_s: float) -> dict:
    """One run's figures; ``counters``: flat ``prefillN:``/``decodeN:``/``router:`` keys, deltas over the run."""
    s = summarize(results, wall_s, slo_ttft_s, slo_tbt_s)
    prefills = sorted({k.split(":", 1)[0] for k in counters if k.startswith("prefill")})
    prompt = _total(counters, "prefill", "prompt_tokens")
    blocks = {src: _total(counters, "decode", f"blocks_{src}") for src in DECODE_BLOCK_SOURCES}
    return {
        "requests": s["requests"], "failed": s["failed"], "errors": s["errors"], "wall_s": round(wall_s, 2),
        "ttft_p50_ms": _ms(s["ttft_s"]["p50"]), "ttft_p99_ms": _ms(s["ttft_s"]["p99"]),
        "tpot_p50_ms": _ms(s["tpot_s"]["p50"]), "tpot_p99_ms": _ms(s["tpot_s"]["p99"]),
        "goodput_rps": s["goodput"], "slo_attained": s["slo_attained"],
        "prompt_tokens": prompt,
        "prefill_tokens_computed": _total(counters, "prefill", "computed_tokens"),
        "kv_bytes_moved": _total(counters, "prefill", "kv_bytes"),
        "decode_prefix_hit_tokens": _total(counters, "decode", "hit_tokens"),
        "prefill_hit_rate": _share(_total(counters, "prefill", "hit_tokens"), prompt),
        "prefill_hit_rates": {p: _share(counters.get(f"{p}:hit_tokens", 0.0), counters.get(f"{p}:prompt_tokens", 0.0))
                              for p in prefills},
        "prefill_prompt_shares": {p: _share(counters.get(f"{p}:prompt_tokens", 0.0), prompt) for p in prefills},
        "router_hit_rate": _share(counters.get("router:hit_blocks", 0.0), counters.get("router:prompt_blocks", 0.0)),
        "router_decisions": {k.split(":", 2)[2]: v for k, v in counters.items() if k.startswith("router:decisions:")},
        "decode_hit_rate": _share(blocks["reused"], sum(blocks.values())),
        "ttft_s": [r.ttft for r in results if r.ok and r.ttft is not None],
        "per_request": [r.to_json() for r in results],  # the raw records the figures come from (issue 52 item 4)
    }


def _median(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize_arms(runs: list[dict], arms: list[str]) -> dict[str, dict]:
    """arm -> median over its runs of each scalar figure (runs carry "arm")."""
    return {arm: {k: _median([r[k] for r in runs if r["arm"] == arm]) for k in SCALARS} for arm in arms}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def ratios(summary: dict[str, dict], baseline: str = BASELINE) -> dict[str, dict]:
    """arm -> figure -> its median over the baseline's median (arms other than the baseline)."""
    if baseline not in summary:
        return {}
    base = summary[baseline]
    return {arm: {k: _ratio(s[k], base[k]) for k in SCALARS if k != "failed"}
            for arm, s in summary.items() if arm != baseline}


def pair_ratios(runs: list[dict], arm: str, key: str, baseline: str = BASELINE) -> list[float]:
    """Per round: the arm's figure over the baseline's of the same round (rounds where both have one)."""
    by_round = {(r["round"], r["arm"]): r[key] for r in runs}
    out = []
    for (rnd, a), v in sorted(by_round.items()):
        b = by_round.get((rnd, baseline))
        if a == arm and v is not None and b:
            out.append(v / b)
    return out


def verdict(ratio: float | None, pairs: list[float], target: float, better: str) -> str:
    """'met' / 'MISSED' (target on the median ratio), and whether the pairs fall on both sides of it."""
    if better not in ("lower", "higher"):
        raise ValueError(f"better must be 'lower' or 'higher', got {better!r}")
    if ratio is None:
        return "no figure"

    def ok(v: float) -> bool:
        return v <= target if better == "lower" else v >= target

    word = "met" if ok(ratio) else "MISSED"
    sides = {ok(p) for p in pairs}
    return word + (" (pairs on both sides of the target)" if len(sides) == 2 else "")
