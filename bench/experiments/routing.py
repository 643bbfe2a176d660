"""Experiment 3, weighted round robin vs round robin with skewed request lengths.

Several decodes with small KV pools; a Poisson stream where a fraction of the requests
are long (a long prompt and a long output that hold many KV blocks for seconds) and the
rest short. Round robin sends the next request to the next decode whatever it holds, so
a long request lands on a decode that is already full and is refused (then retried on
another decode). Weighted round robin weighs decodes by their reported free KV memory.
Both policies get the same requests at the same times, each on a fresh cluster.
Figures: KV allocation refusals (summed over the decodes' /metrics), prefill's retries,
failed requests, P99 TTFT. Target: WRR has no refusals where RR has some.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from pdserve.bench.loadgen_report import percentile
from pdserve.bench.loadgen_workload import RequestSpec, arrival_times, make_prompt_ids

from . import report
from .client import send
from .cluster import start_pd
from .launcher import LOG_ROOT, MODEL_CACHE, PROMPT_VOCAB, Launcher, bench_model, metric_sum, scrape


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="tiny | small | medium | wire | a checkpoint directory")
    parser.add_argument("--decodes", type=int, default=3, help="decode processes")
    parser.add_argument("--decode-blocks", type=int, default=40, help="KV blocks of each decode (64 tokens each)")
    parser.add_argument("--requests", type=int, default=60, help="requests per policy")
    parser.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second")
    parser.add_argument("--pattern", choices=["random", "periodic"], default="random",
                        help="random: each request is long with --long-fraction; periodic: every --decodes-th "
                             "request is long (lengths in step with round robin's cycle; ignores --long-fraction)")
    parser.add_argument("--long-fraction", type=float, default=0.25, help="fraction of long requests")
    parser.add_argument("--long-prompt", type=int, default=1400, help="tokens of a long prompt")
    parser.add_argument("--long-output", type=int, default=200, help="output tokens of a long request")
    parser.add_argument("--short-prompt", type=int, default=100, help="tokens of a short prompt")
    parser.add_argument("--short-output", type=int, default=32, help="output tokens of a short request")
    parser.add_argument("--max-attempts", type=int, default=3, help="prefill's --max-attempts")
    parser.add_argument("--out", type=Path, default=Path("bench-results/experiments"), help="output directory")


def workload(args) -> tuple[list[RequestSpec], list[float]]:
    rng = random.Random(3)
    specs = []
    period = args.decodes
    for i in range(args.requests):
        if (rng.random() < args.long_fraction) if args.pattern == "random" else (i % period == 0):
            p, o = args.long_prompt, args.long_output
        else:
            p, o = args.short_prompt, args.short_output
        specs.append(RequestSpec(p, o, prompt_ids=make_prompt_ids(p, rng, PROMPT_VOCAB)))
    return specs, arrival_times(len(specs), args.rate, "poisson", random.Random(4))


def run_policy(args, policy: str, model: str, specs, arrivals, out: Path) -> dict:
    max_len = args.long_prompt + args.long_output + 64
    with Launcher(LOG_ROOT / f"routing-{policy}") as launcher:
        cluster = start_pd(launcher, model, args.decodes, prefill_threads=1, decode_threads=1,
                           num_blocks=max(256, 2 * args.decode_blocks),
                           decode_blocks=[args.decode_blocks] * args.decodes,
                           max_model_len=max_len,
                           prefill_extra=["--policy", policy, "--max-attempts", str(args.max_attempts)])
        send(cluster.url, specs[:2], concurrency=1)  # warm-up
        before = [scrape(d.metrics_url) for d in cluster.decodes], scrape(cluster.prefill.metrics_url)
        results, wall = send(cluster.url, specs, arrivals=arrivals)
        after = [scrape(d.metrics_url) for d in cluster.decodes], scrape(cluster.prefill.metrics_url)
    refusals = [metric_sum(a, "pdserve_kv_allocation_refusals_total")
                - metric_sum(b, "pdserve_kv_allocation_refusals_total")
                for b, a in zip(before[0], after[0])]
    selections = {
        d: (metric_sum(after[1], "pdserve_decode_selections_total", decode=d)
            - metric_sum(before[1], "pdserve_decode_selections_total", decode=d))
        for d in (c.grpc for c in cluster.decodes)}
    retries = (metric_sum(after[1], "pdserve_decode_retries_total")
               - metric_sum(before[1], "pdserve_decode_retries_total"))
    ttfts = [r.ttft for r in results if r.ok]
    long_ttfts = [r.ttft for r in results if r.ok and r.prompt_tokens == args.long_prompt]
    return {
        "refusals": sum(refusals), "refusals_per_decode": refusals, "retries": retries, "selections": selections,
        "failed": sum(not r.ok for r in results), "errors": [r.error for r in results if not r.ok][:5],
        "ttft_p50_ms": _ms(percentile(ttfts, 50)), "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "long_ttft_p99_ms": _ms(percentile(long_ttfts, 99)), "wall_s": wall, "ttft_s": ttfts,
    }


def _ms(v):
    return None if v is None else round(v * 1000, 1)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not 0 <= args.long_fraction <= 1:
        raise SystemExit("--long-fraction must be in [0, 1]")
    model = bench_model(MODEL_CACHE, args.model)
    specs, arrivals = workload(args)
    runs = {policy: run_policy(args, policy, model, specs, arrivals, out) for policy in ("rr", "wrr")}
    met = runs["rr"]["refusals"] > 0 and runs["wrr"]["refusals"] == 0
    figures = {p: {k: v for k, v in r.items() if k != "ttft_s"} for p, r in runs.items()}
    figures.update(target="WRR 0 refusals where RR has some", met=met,
                   comparable=runs["rr"]["refusals"] > 0)
    name = "routing" if args.pattern == "random" else f"routing-{args.pattern}"
    png = plot(runs, out / f"{name}.png")
    path = report.save(out, name, {"model": model, "params": {k: str(v) for k, v in vars(args).items()},
                                       "figures": figures, "plot": str(png), "runs": runs})
    for p in ("rr", "wrr"):
        r = runs[p]
        print(f"  {p:>3}: refusals {r['refusals']:.0f} (per decode {r['refusals_per_decode']}), "
              f"retries {r['retries']:.0f}, failed {r['failed']}, TTFT p50 {r['ttft_p50_ms']} ms "
              f"p99 {r['ttft_p99_ms']} ms")
    print(f"WRR vs RR: {'met' if met else 'MISSED'} (target: WRR no refusals where RR has some)")
    print(f"wrote {path} and {png}")
    return 0


def plot(runs: dict, path: Path) -> Path:
    return report.bars_and_ttft_cdf(
        path, "Experiment 3: weighted round robin (free KV) vs round robin",
        {f"{n}\nrefusals": r["refusals"] for n, r in runs.items()}, "KV allocation refusals (all decodes)",
        {n: r["ttft_s"] for n, r in runs.items()}, ["tab:orange", "tab:blue"])
