"""Experiment 8, SLO classes and the global queue (QLM): fifo vs edf vs qlm on one trace.

One prefill and one decode whose KV pool holds a few requests at once, so requests queue
at the prefill (the global queue). The trace: interactive requests in a Poisson stream plus
batch requests in bursts, lengths log-normal (ShareGPT-like: most short, a long tail; batch
prompts and outputs longer). QLM's classes (interactive 20 s, batch-1 1 min, batch-2 1 h on
A100s) are scaled to this machine: interactive TTFT ``--interactive-ttft-ms`` and end to end
``--interactive-e2e-ms``, batch end to end ``--batch-e2e-ms``. Requests pick their class with
vLLM's ``priority`` field (interactive 0, batch 1). Each policy gets the same requests at the
same times on a fresh cluster after the same warm-up.

Figures per policy: SLO attainment per class (from the client's TTFT, mean time between
tokens and e2e against the class's targets; failed or rejected requests miss), goodput
(requests meeting their SLO per second), batch throughput (batch output tokens per second
from the first burst to the last batch answer), interactive TTFT P50/P99, the estimator's
median relative error (|estimate at arrival - actual| / actual, completion time of every
served request and waiting time of the requests that waited), the policy's mean decision
cost. Targets (issue 11): interactive attainment >= 0.95 where fifo's < 0.7; batch throughput
>= 0.9x fifo's; estimator median error <= 20%.

The defaults fit the built-in ``tiny`` model (a decode step of a few ms here). At 122M parameters
(``--model peer``: the peer experiment's random Llama, written once by ``peer_model.py``) a decode
step of a few requests takes 45-57 ms on one core here (the peer experiment's TPOT at 512 / 64), about
3.5 times ``tiny``'s (its batch requests, about three at a time, decoded at 184 tok/s: 16 ms a step),
so every time is stretched 4 times and the lengths kept: interactive ``--rate 0.375``, bursts of 16
``--burst-every 80``, ``--interactive-ttft-ms 8000 --interactive-e2e-ms 24000 --batch-e2e-ms 720000``;
``--duration 160`` (two bursts instead of three; two policies planned for about 12 minutes on a quiet
box, not yet seen: the one attempt, at load 14-83, was stopped after 18 minutes of fifo).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.loadgen import LoadConfig, send_one
from pdserve.bench.loadgen_report import RequestResult, percentile
from pdserve.bench.loadgen_workload import LengthDistribution, RequestSpec, arrival_times, make_prompt_ids
from pdserve.slo import classes as slo_classes

from . import report
from .cluster import SERVED_MODEL, start_pd
from .launcher import LOG_ROOT, MODEL_HELP, PROMPT_VOCAB, Launcher, experiment_model, metric_sum, scrape

CLASS_PRIORITY = {"interactive": 0, "batch": 1}
MAX_MODEL_LEN = 800 + 400 + 64  # the longest prompt and output of LENGTHS, and a block


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help=MODEL_HELP)
    parser.add_argument("--policies", default="fifo,edf,qlm", help="queue policies to compare, comma separated")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--rate", type=float, default=1.5, help="interactive requests per second (Poisson)")
    parser.add_argument("--burst", type=int, default=12, help="batch requests per burst")
    parser.add_argument("--burst-every", type=float, default=20.0, help="seconds between bursts (first at 2 s)")
    parser.add_argument("--decode-blocks", type=int, default=24, help="KV blocks of the decode (64 tokens each)")
    parser.add_argument("--interactive-ttft-ms", type=int, default=2000)
    parser.add_argument("--interactive-e2e-ms", type=int, default=6000)
    parser.add_argument("--batch-e2e-ms", type=int, default=180000)
    parser.add_argument("--early-reject", action="store_true", help="interactive requests use early rejection")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench-results/experiments"), help="output directory")


@dataclass(slots=True)
class Item:
    at: float
    cls: str
    spec: RequestSpec


@dataclass
class ClassLoad(LoadConfig):
    """The load generator's request, with vLLM's priority field choosing the SLO class."""

    priority: int = 0

    def payload(self, spec: RequestSpec) -> dict:
        return {**LoadConfig.payload(self, spec), "priority": self.priority}


def slo_config(args) -> dict:
    return {"ttftMs": args.interactive_ttft_ms, "e2eMs": args.interactive_e2e_ms, "defaultClass": "interactive",
            "classes": [
                {"name": "interactive", "ttftMs": args.interactive_ttft_ms, "e2eMs": args.interactive_e2e_ms,
                 "earlyReject": bool(args.early_reject), "priority": CLASS_PRIORITY["interactive"]},
                {"name": "batch", "e2eMs": args.batch_e2e_ms, "priority": CLASS_PRIORITY["batch"]}]}


LENGTHS = {"interactive": (LengthDistribution(120, 0.8, 16, 600), LengthDistribution(48, 0.7, 8, 160)),
           "batch": (LengthDistribution(300, 0.5, 64, 800), LengthDistribution(200, 0.4, 64, 400))}


def sample(cls: str, rng: random.Random) -> RequestSpec:
    p, o = (d.sample(rng) for d in LENGTHS[cls])
    return RequestSpec(p, o, prompt_ids=make_prompt_ids(p, rng, PROMPT_VOCAB))


def warmup(seed: int) -> list[Item]:
    """Sent one at a time before the trace (not measured): three of each class, from the trace's
    distributions, so that the estimator has seen prefills, decodes and output lengths."""
    rng = random.Random(seed + 100)
    return [Item(0.0, c, sample(c, rng)) for c in ("interactive", "batch") * 3]


def workload(args) -> list[Item]:
    rng = random.Random(args.seed)
    n = max(1, round(args.rate * args.duration))
    times = [t for t in arrival_times(n * 2, args.rate, "poisson", random.Random(args.seed + 1)) if t < args.duration]
    items = [(t, "interactive") for t in times]
    burst_at = 2.0
    while burst_at < args.duration:
        items += [(burst_at + 0.01 * i, "batch") for i in range(args.burst)]
        burst_at += args.burst_every
    return [Item(t, cls, sample(cls, rng)) for t, cls in sorted(items)]


async def send_items(url: str, items: list[Item], timeout: float) -> list[RequestResult]:
    import aiohttp

    configs = {c: ClassLoad(url=url, model=SERVED_MODEL, progress=False, request_timeout=timeout, priority=p)
               for c, p in CLASS_PRIORITY.items()}
    results = [RequestResult(i, it.spec.prompt_tokens, it.spec.output_tokens) for i, it in enumerate(items)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()

        async def at(i: int, item: Item) -> None:
            await asyncio.sleep(max(0.0, t0 + item.at - time.perf_counter()))
            await send_one(session, configs[item.cls], item.spec, results[i], t0)
        await asyncio.gather(*(at(i, it) for i, it in enumerate(items)))
    return results


def run_policy(args, policy: str, model: str, items: list[Item]) -> dict:
    slo = slo_config(args)
    classes = slo_classes.parse(slo)
    with Launcher(LOG_ROOT / f"slo-{policy}") as launcher:
        cluster = start_pd(launcher, model, 1, prefill_threads=1, decode_threads=1, num_blocks=256,
                           decode_blocks=[args.decode_blocks], max_model_len=MAX_MODEL_LEN,
                           prefill_extra=["--queue-policy", policy, "--slo-classes", json.dumps(slo),
                                          "--queue-timeout", "600", "--load-report-interval", "0.1"])
        for w in warmup(args.seed):
            asyncio.run(send_items(cluster.url, [w], 120))
        results = asyncio.run(send_items(cluster.url, items, 900))
        with urllib.request.urlopen(cluster.url + "/debug/slo?recent=100000", timeout=10) as resp:
            debug = json.loads(resp.read())
        metrics = scrape(cluster.prefill.metrics_url)
    return summarize(args, classes, items, results, debug, metrics)


def summarize(args, classes, items, results, debug, metrics) -> dict:
    per_class: dict[str, dict] = {}
    met_total = 0
    for name in CLASS_PRIORITY:
        cls = classes.by_name[name]
        mine = [(it, r) for it, r in zip(items, results) if it.cls == name]
        met = [r for _, r in mine if r.ok and all(cls.verdict(r.ttft, r.e2e, r.tokens_out).values())]
        met_total += len(met)
        ttfts = [r.ttft for _, r in mine if r.ok]
        per_class[name] = {
            "requests": len(mine), "ok": sum(r.ok for _, r in mine), "met": len(met),
            "attainment": len(met) / len(mine) if mine else None,
            "rejected": sum(r.status == 429 for _, r in mine),
            "failed": sum(not r.ok and r.status != 429 for _, r in mine),
            "ttft_p50_ms": _ms(percentile(ttfts, 50)), "ttft_p99_ms": _ms(percentile(ttfts, 99)),
            "e2e_p50_ms": _ms(percentile([r.e2e for _, r in mine if r.ok], 50)),
        }
    batch = [(it, r) for it, r in zip(items, results) if it.cls == "batch" and r.ok]
    first_burst = min((it.at for it in items if it.cls == "batch"), default=0.0)
    last_done = max((r.sent_at + r.e2e for _, r in batch), default=first_burst)
    batch_tokens = sum(r.tokens_out for _, r in batch)
    end = max((r.sent_at + (r.e2e or 0.0) for r in results), default=args.duration)
    served = [r for r in debug["recent"] if r["outcome"] == "ok" and r["estimate"]]
    e2e_err = [abs(r["estimate"]["e2e"] - r["actual"]["e2e"]) / r["actual"]["e2e"] for r in served
               if r["actual"]["e2e"]]
    waited = [r for r in served if (r["actual"]["wait"] or 0) > 0.1]
    wait_err = [abs(r["estimate"]["wait"] - r["actual"]["wait"]) / r["actual"]["wait"] for r in waited]
    count = metric_sum(metrics, "pdserve_slo_policy_seconds_count")
    return {
        "classes": per_class, "goodput_rps": met_total / end if end else None,
        "batch_tokens_per_s": batch_tokens / (last_done - first_burst) if last_done > first_burst else None,
        "estimator": {"e2e_median_rel_error": _median(e2e_err), "e2e_p90_rel_error": _pct(e2e_err, 90),
                      "wait_median_rel_error": _median(wait_err), "requests": len(e2e_err), "waited": len(wait_err)},
        "policy_decisions": count, "estimator_state": debug["estimator"],
        "policy_mean_decision_ms": (metric_sum(metrics, "pdserve_slo_policy_seconds_sum") / count * 1000
                                    if count else None),
        "wall_s": end,
        "ttft_s": {c: [r.ttft for it, r in zip(items, results) if it.cls == c and r.ok] for c in CLASS_PRIORITY},
        # per served request: class, tokens, estimated / actual wait, estimated / actual completion (s)
        "records": [[r["slo_class"], r["tokens"], _r(r["estimate"]["wait"]), _r(r["actual"]["wait"]),
                     _r(r["estimate"]["e2e"]), _r(r["actual"]["e2e"])] for r in served],
        "errors": [r.error for r in results if not r.ok][:5],
    }


def _r(v):
    return None if v is None else round(v, 4)


def _ms(v):
    return None if v is None else round(v * 1000, 1)


def _median(xs):
    return round(statistics.median(xs), 3) if xs else None


def _pct(xs, p):
    v = percentile(xs, p)
    return None if v is None else round(v, 3)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    try:
        model = experiment_model(args.model, MAX_MODEL_LEN)
    except ValueError as e:
        raise SystemExit(f"slo: {e}") from None
    items = workload(args)
    print(f"trace: {sum(i.cls == 'interactive' for i in items)} interactive, {sum(i.cls == 'batch' for i in items)} "
          f"batch over {args.duration:g}s")
    runs = {}
    for policy in policies:
        runs[policy] = run_policy(args, policy, model, items)
        _print(policy, runs[policy])
    figures = {p: {k: v for k, v in r.items() if k not in ("ttft_s", "records")} for p, r in runs.items()}
    figures["targets"] = targets(runs)
    png = plot(runs, out / "slo.png")
    path = report.save(out, "slo", {"model": model, "params": {k: str(v) for k, v in vars(args).items()},
                                    "slo": slo_config(args), "figures": figures, "plot": str(png), "runs": runs})
    for line in figures["targets"]["lines"]:
        print(line)
    print(f"wrote {path} and {png}")
    return 0


def targets(runs: dict) -> dict:
    lines, out = [], {}
    fifo = runs.get("fifo")
    for p in ("edf", "qlm"):
        if p not in runs or fifo is None:
            continue
        inter, base = runs[p]["classes"]["interactive"]["attainment"], fifo["classes"]["interactive"]["attainment"]
        thr = report.ratio(runs[p]["batch_tokens_per_s"], fifo["batch_tokens_per_s"])
        ok_att = inter is not None and inter >= 0.95 and base is not None and base < 0.7
        out[p] = {"interactive_attainment": inter, "fifo_interactive_attainment": base, "batch_throughput_x_fifo": thr,
                  "attainment_met": ok_att, "throughput_met": thr is not None and thr >= 0.9}
        lines.append(f"{p}: interactive attainment {inter:.3f} vs fifo {base:.3f} (target >= 0.95 where fifo < 0.7): "
                     f"{'met' if ok_att else 'MISSED'}; batch throughput {thr:.2f}x fifo (target >= 0.9): "
                     f"{'met' if thr is not None and thr >= 0.9 else 'MISSED'}")
    for p, r in runs.items():
        err = r["estimator"]["e2e_median_rel_error"]
        lines.append(f"{p}: estimator median error {err} of completion time (target <= 0.2): "
                     f"{'met' if err is not None and err <= 0.2 else 'MISSED'}")
    out["lines"] = lines
    return out


def _print(policy: str, r: dict) -> None:
    c = r["classes"]
    print(f"  {policy:>4}: interactive {c['interactive']['met']}/{c['interactive']['requests']} met "
          f"(TTFT p50 {c['interactive']['ttft_p50_ms']} p99 {c['interactive']['ttft_p99_ms']} ms, rejected "
          f"{c['interactive']['rejected']}), batch {c['batch']['met']}/{c['batch']['requests']} met, batch "
          f"{r['batch_tokens_per_s'] or 0:.1f} tok/s, goodput {r['goodput_rps'] or 0:.2f} req/s, estimator error "
          f"e2e {r['estimator']['e2e_median_rel_error']} wait {r['estimator']['wait_median_rel_error']}, "
          f"decision {r['policy_mean_decision_ms'] or 0:.2f} ms")


def plot(runs: dict, path: Path) -> Path:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    names = list(runs)
    width = 0.35
    for j, cls in enumerate(CLASS_PRIORITY):
        axes[0].bar([i + j * width for i in range(len(names))],
                    [runs[n]["classes"][cls]["attainment"] or 0 for n in names], width, label=cls)
    axes[0].set_xticks([i + width / 2 for i in range(len(names))], names)
    axes[0].set_ylim(0, 1.05)
    axes[0].set_title("SLO attainment by class")
    axes[0].legend()
    for n in names:
        report.cdf(axes[1], runs[n]["ttft_s"]["interactive"], n)
    axes[1].set_xscale("log")
    axes[1].set_xlabel("interactive TTFT (ms)")
    axes[1].set_ylabel("fraction of requests")
    axes[1].set_title("CDF of interactive TTFT")
    axes[1].legend()
    axes[1].grid(True, alpha=0.3)
    for n in names:
        recs = runs[n]["records"]
        axes[2].scatter([r[5] for r in recs], [r[4] for r in recs], s=6, label=n)
    top = max([max(r[4], r[5]) for n in names for r in runs[n]["records"]] or [1.0])
    axes[2].plot([0, top], [0, top], color="grey", lw=1)
    axes[2].set_xlabel("actual completion time (s)")
    axes[2].set_ylabel("estimate at arrival (s)")
    axes[2].set_title("waiting-time estimator")
    axes[2].legend()
    fig.suptitle("Experiment 8: SLO-aware global queue (QLM) vs EDF vs FIFO")
    return report.save_figure(fig, path)
