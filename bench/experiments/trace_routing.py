"""Prefix routing re-measured on real chat traffic (issue 33 item 3): Mooncake's conversation trace through
2 (``--prefills 3``: 3) prefills + 2 decodes behind ``pdserve router``, round robin vs least loaded vs
prefix-aware.

Each run: a fresh cluster (cold caches), the same requests at the same times (``trace_workload.py``:
conversations sampled, a window, time and lengths scaled; named in every result), arms alternating
round by round (A B C A B C, ``--repeats`` rounds). Per arm (medians over its runs): P50/P99 TTFT,
P50/P99 TPOT, prompt tokens the prefills computed (``pdserve_prompt_tokens_computed_total``), KV
moved prefill -> decode, decode-side prefix hits, failed requests, goodput under the SLO of
``--slo-ttft-ms`` / ``--slo-tbt-ms`` (the InferenceService's defaults, ``operator/crd_schema.py``);
ratios over round robin; and the cache hit rates that explain them: each prefill's, the router's
index, the decodes', beside the trace's own ceiling (``trace_workload.reuse_ceiling``: what one
unlimited cache would hit, and what round robin's unlimited caches would).

The arms (``ARMS``). ``pdserve router`` has two policies, ``prefix`` and ``round-robin``; none is
purely load-aware. The closest, ``least-loaded``, is ``prefix`` with ``--load-weight`` 10^6 (the
CRD's maximum): a request in flight outweighs any prompt, so the prefill with the fewest requests
in flight wins and the cached prefix only breaks ties between equally loaded prefills (at light load,
when both are idle, it routes as ``prefix`` does).

Why this model and scale (defaults). The built-in ``small`` model: a 1K-token prefill takes about
0.25 s of one core here (512 tokens 0.11 s, 2K 0.6 s, 4K 1.7 s; ``tiny`` needs 0.06 s for 1.9K and
holds only 2,048 positions), so the compute a cached prefix saves is seconds of queueing, not
microseconds. Lengths x1/8: a trace block (512 tokens) becomes 64 tokens, one KV block of the
engine, so a shared trace block is a shared cache block; prompts (median 860, mean 1.5K tokens)
are cut at 4K, outputs at 32 tokens (the decodes share the 2 cores). 1% of the conversations of
the whole hour (185 requests with seed 0), time scaled so they arrive over 90 s: about 100
core-seconds of prefill without any cache hit. With cluster start-up, 6 runs (3 arms x 2) take
about 12 minutes on a quiet 2-core box.

At 122M parameters (``--model peer``: the peer experiment's random Llama, hidden 1024, 8 layers,
written once by ``peer_model.py``): a 1K-token prefill takes about 2 s of a core, 8 times ``small``'s,
so the same load (about 1.1 cores of prefill without cache hits) is 0.4% of the conversations (75
requests with seed 0, 83K prompt tokens after the cut) over 150 s, prompts cut at 2K (the checkpoint
holds 4,096 positions), and the SLO scaled as the peer experiment's trace cell at this model scales
it (TTFT <= 8 s, TBT <= 200 ms): ``--model peer --sample 0.004 --duration 150 --max-prompt-tokens 2048
--slo-ttft-ms 8000 --slo-tbt-ms 200 --request-timeout 300``; with ``--arms round-robin,prefix`` 4 runs
take about 15 minutes.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pdserve.defaults import BLOCK_SIZE

from . import report
from .client import send
from .cluster import Cluster, start_routed
from .launcher import LOG_ROOT, MODEL_HELP, PROMPT_VOCAB, Launcher, experiment_model, metric_sum, scrape
from .prefix import wait_routable
from .trace_routing_figures import (BASELINE, DECODE_BLOCK_SOURCES, DECODE_COUNTERS, PREFILL_COUNTERS,
                                    ROUTER_COUNTERS, TARGETS, arm_order, counter_delta, pair_ratios, ratios,
                                    run_figures, summarize_arms, verdict)
from ..provenance import run_start
from ..trace_replay import MOONCAKE_TRACE
from .trace_workload import TraceWorkload, build_workload, reuse_ceiling

LEAST_LOADED_WEIGHT = 1_000_000  # prompt tokens per request in flight: more than any prompt (the CRD's maximum)
ARMS: dict[str, list[str]] = {  # arm -> router flags
    "round-robin": ["--policy", "round-robin"],
    "least-loaded": ["--policy", "prefix", "--load-weight", str(LEAST_LOADED_WEIGHT)],
    "prefix": ["--policy", "prefix"],
}
ARM_COLORS = {"round-robin": "tab:orange", "least-loaded": "tab:green", "prefix": "tab:blue"}
DEFAULT_TRACE = MOONCAKE_TRACE  # bench/traces/, shipped with the repository


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload (the module help says why these defaults)")
    g.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="the trace file (default: %(default)s)")
    g.add_argument("--format", choices=["mooncake", "azure"], default="mooncake", help="the trace's format")
    g.add_argument("--sample", type=float, default=0.01, help="fraction of the conversations replayed")
    g.add_argument("--seed", type=int, default=0, help="seed of the sampling and of the prompts' tokens")
    g.add_argument("--window-start", type=float, default=0.0, help="trace seconds where the window starts")
    g.add_argument("--window", type=float, default=None, help="trace seconds of the window (default: to the end)")
    g.add_argument("--max-requests", type=int, default=None, help="at most this many requests of the window")
    g.add_argument("--duration", type=float, default=90.0,
                   help="seconds the replayed arrivals span (sets the time scale)")
    g.add_argument("--length-scale", type=float, default=0.125, help="prompt and output lengths x this")
    g.add_argument("--max-prompt-tokens", type=int, default=4096, help="prompts cut here after scaling")
    g.add_argument("--max-output-tokens", type=int, default=32, help="outputs cut here after scaling")
    g = parser.add_argument_group("cluster and arms")
    g.add_argument("--model", default="small", help=MODEL_HELP)
    g.add_argument("--prefills", type=int, default=2, help="prefills behind the router (2 or 3)")
    g.add_argument("--decodes", type=int, default=2, help="decodes")
    g.add_argument("--num-blocks", type=int, default=1536, help="KV blocks of every server (64 tokens each)")
    g.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    g.add_argument("--repeats", type=int, default=2, help="rounds of every arm, alternating (medians reported)")
    g = parser.add_argument_group("report")
    g.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="goodput's TTFT target (InferenceService default)")
    g.add_argument("--slo-tbt-ms", type=float, default=100.0,
                   help="goodput's mean TBT target (InferenceService default)")
    g.add_argument("--request-timeout", type=float, default=120.0, help="seconds before a request counts as failed")
    g.add_argument("--out", type=Path, default=Path("bench-results/experiments"), help="output directory")


def counters(cluster: Cluster) -> dict[str, float]:
    """The counters run_figures reads, flat: prefillN:name, decodeN:name, router:name, router:decisions:reason."""
    out: dict[str, float] = {}
    for i, p in enumerate(cluster.prefills):
        s = scrape(p.metrics_url)
        out |= {f"prefill{i}:{k}": metric_sum(s, name) for k, name in PREFILL_COUNTERS.items()}
    for i, d in enumerate(cluster.decodes):
        s = scrape(d.metrics_url)
        out |= {f"decode{i}:{k}": metric_sum(s, name) for k, name in DECODE_COUNTERS.items()}
        out |= {f"decode{i}:blocks_{src}": metric_sum(s, "pdserve_kv_prompt_blocks_total", source=src)
                for src in DECODE_BLOCK_SOURCES}
    s = scrape(cluster.prefill.metrics_url)  # the router
    out |= {f"router:{k}": metric_sum(s, name) for k, name in ROUTER_COUNTERS.items()}
    for (name, labels), v in s.items():
        if name == "pdserve_router_decisions_total":
            key = f"router:decisions:{dict(labels).get('reason', '')}"
            out[key] = out.get(key, 0.0) + v
    return out


def run_arm(args, arm: str, round_no: int, model: str, work: TraceWorkload) -> dict:
    max_len = work.max_prompt_tokens + work.max_output_tokens + 64
    with Launcher(LOG_ROOT / f"trace-routing-{arm}-{round_no}") as launcher:
        cluster = start_routed(launcher, model, args.prefills, args.decodes, threads=1, num_blocks=args.num_blocks,
                               max_model_len=max_len, router_extra=ARMS[arm])
        wait_routable(cluster)
        before = counters(cluster)
        results, wall = send(cluster.url, work.specs, arrivals=work.arrivals, timeout=args.request_timeout)
        after = counters(cluster)
    figures = run_figures(results, wall, counter_delta(before, after), args.slo_ttft_ms / 1000, args.slo_tbt_ms / 1000)
    return {"arm": arm, "round": round_no, **figures}


def _arms(text: str) -> list[str]:
    arms = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise SystemExit(f"--arms: unknown {unknown} (choose from {', '.join(ARMS)})")
    return arms


def run(args: argparse.Namespace) -> int:
    if args.prefills < 2:
        raise SystemExit("--prefills must be >= 2 (routing needs a choice)")
    if not args.trace.is_file():
        raise SystemExit(f"--trace {args.trace}: no such file (run from the repository root, or give its path)")
    try:
        order = arm_order(_arms(args.arms), args.repeats)
        work = build_workload(args.trace, args.format, fraction=args.sample, duration_s=args.duration,
                              length_scale=args.length_scale, pool=list(range(1, PROMPT_VOCAB)),
                              start_s=args.window_start, window_s=args.window, max_requests=args.max_requests,
                              max_prompt_tokens=args.max_prompt_tokens, max_output_tokens=args.max_output_tokens,
                              seed=args.seed)
        model = experiment_model(args.model, args.max_prompt_tokens + args.max_output_tokens + 64)
    except ValueError as e:
        raise SystemExit(f"trace-routing: {e}") from None
    arms = _arms(args.arms)
    ceiling = reuse_ceiling(work.specs, args.prefills, BLOCK_SIZE)
    bound = ceiling["computed_ratio_bound"]
    print(f"workload: {work.describe()}; {work.prompt_tokens} prompt tokens")
    print(f"reuse ceiling (unlimited caches): one cache {ceiling['one_cache']:.2f} of prompt tokens, "
          f"round robin over {args.prefills} {ceiling['round_robin']:.2f}"
          + (f": prompt tokens computed at best {bound:.2f}x of round robin's" if bound is not None else ""))
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    t0 = time.monotonic()
    for i, (round_no, arm) in enumerate(order):
        print(f"run {i + 1}/{len(order)} (round {round_no + 1}): {arm} ...", flush=True)
        runs.append(run_arm(args, arm, round_no, model, work))
    summary = summarize_arms(runs, arms)
    rel = ratios(summary)
    verdicts = {}
    if "prefix" in rel:
        verdicts = {k: verdict(rel["prefix"][k], pair_ratios(runs, "prefix", k), target, better)
                    for k, (target, better) in TARGETS.items()}
    png = plot(runs, arms, summary, ceiling, work.describe(), args, args.out / "trace_routing.png")
    figures = {"arms": summary, "ratios_vs_round_robin": rel, "verdicts_prefix": verdicts, "reuse_ceiling": ceiling}
    path = report.save(args.out, "trace_routing", {
        "model": model, "workload": work.describe(), "params": {k: str(v) for k, v in vars(args).items()},
        "elapsed_s": round(time.monotonic() - t0, 1), "figures": figures, "plot": str(png), "runs": runs})
    _print(arms, summary, rel, verdicts)
    print(f"wrote {path} and {png} ({time.monotonic() - t0:.0f} s)")
    return 0


def _print(arms, summary, rel, verdicts) -> None:
    def pct(v):
        return "-" if v is None else f"{v * 100:.0f}%"
    for arm in arms:
        s = summary[arm]
        print(f"  {arm:>12}: TTFT p50 {s['ttft_p50_ms']} p99 {s['ttft_p99_ms']} ms, TPOT p50 {s['tpot_p50_ms']} "
              f"p99 {s['tpot_p99_ms']} ms, goodput {s['goodput_rps']:.2f} req/s (SLO met {pct(s['slo_attained'])}), "
              f"computed {s['prefill_tokens_computed']:.0f} tok, KV moved {s['kv_bytes_moved'] / 2**20:.1f} MiB, "
              f"decode hits {s['decode_prefix_hit_tokens']:.0f} tok, failed {s['failed']:.0f}; hit rates: prefills "
              f"{pct(s['prefill_hit_rate'])}, router index {pct(s['router_hit_rate'])}, decodes "
              f"{pct(s['decode_hit_rate'])}")
    for arm, r in rel.items():
        print(f"  {arm} / {BASELINE}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()
                                                   if v is not None and not k.endswith("hit_rate")))
    for k, v in verdicts.items():
        target, better = TARGETS[k]
        print(f"prefix / round-robin {k}: {v} (target {'<=' if better == 'lower' else '>='} {target})")


def plot(runs: list[dict], arms: list[str], summary: dict, ceiling: dict, workload: str, args, path: Path) -> Path:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.8))
    colors = [ARM_COLORS[a] for a in arms]
    axes[0].set_prop_cycle(color=colors)
    report.ttft_cdf_panel(axes[0], {arm: [t for r in runs if r["arm"] == arm for t in r["ttft_s"]] for arm in arms},
                          title="CDF of TTFT (all runs)")
    for ax, key, title in ((axes[1], "prefill_tokens_computed", "prompt tokens prefills computed"),
                           (axes[2], "goodput_rps", f"goodput (req/s, TTFT <= {args.slo_ttft_ms:g} ms, "
                                                    f"TBT <= {args.slo_tbt_ms:g} ms)"),
                           (axes[3], "prefill_hit_rate", "prefill prefix-cache hit rate")):
        ax.bar(arms, [summary[a][key] or 0 for a in arms], color=colors)
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    axes[3].axhline(ceiling["one_cache"], color="k", ls="--", lw=1, label="trace ceiling, one cache")
    axes[3].axhline(ceiling["round_robin"], color="gray", ls=":", lw=1, label="trace ceiling, round robin")
    axes[3].legend(fontsize=7)
    m = run_start()
    fig.suptitle(f"Prefix routing on Mooncake's conversation trace: {args.prefills} prefills + {args.decodes} decodes "
                 f"behind pdserve router, model {args.model} -- {m['cpu_model']} ({m['cpus']} CPUs), "
                 f"{m['utc'][:10]}\n{workload}", fontsize=9)
    return report.save_figure(fig, path, record=m)
