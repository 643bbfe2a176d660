"""Token gaps of pdserve's P/D with the start-up heap frozen and without, A B A B (pdserve.gc_pauses).

    .venv/bin/python tools/bench_gc_freeze.py [--rounds 2] [--prompt 512 --output 64 --rate 0.4 --requests 16]

Each round starts the peer experiment's P/D pair twice (one prefill on CPU 0, one decode on CPU 1,
one thread each, tcp), first with ``PDSERVE_GC_FREEZE=0`` then with the default (frozen), or the
other way round in odd rounds, and sends both the same Poisson trace of streamed requests with
exactly --prompt / --output tokens. Per run it prints the clients' TPOT mean and ITL P50/P99, and
the full collections the decode and the prefill made while serving and how long they took
(``pdserve_gc_full_collection_seconds``); at the end the medians per side and the ratio
frozen / not frozen. The checkpoint is the peer experiment's (written on first use).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics

from pdserve.bench.experiments.cluster import SERVED_MODEL, start_pd
from pdserve.bench.experiments.launcher import LOG_ROOT, MODEL_CACHE, Launcher, metric_sum, scrape
from pdserve.bench.experiments.peer_model import peer_model
from pdserve.bench.experiments.peer_report import run_figures
from pdserve.bench.loadgen import LoadConfig, send_requests
from pdserve.bench.loadgen_report import summarize
from pdserve.bench.loadgen_workload import arrival_times, random_requests, tokenizer_prompt_ids
from pdserve.defaults import BLOCK_SIZE
from pdserve.gc_pauses import ENV_FREEZE

GC = "pdserve_gc_full_collection_seconds"


def _gc(url: str) -> tuple[float, float]:
    samples = scrape(url + "/metrics")
    return metric_sum(samples, GC + "_count"), metric_sum(samples, GC + "_sum")


def one_run(frozen: bool, model: str, pool: list[int], args, name: str) -> dict:
    os.environ[ENV_FREEZE] = "1" if frozen else "0"  # the servers inherit it
    extra = ["--transfer", "tcp", "--dtype", "float32"]
    with Launcher(LOG_ROOT / name) as launcher:
        c = start_pd(launcher, model, 1, prefill_threads=1, decode_threads=1, prefill_cpus="0", decode_cpus="1",
                     num_blocks=16384 // BLOCK_SIZE, max_model_len=4096, prefill_extra=extra, decode_extra=extra)
        config = LoadConfig(url=c.url, model=SERVED_MODEL, progress=False, request_timeout=600)
        warm = random_requests(2, args.prompt, 8, random.Random(-1), pool)
        asyncio.run(send_requests(config, warm, concurrency=1))
        before = {"decode": _gc(c.decodes[0].url), "prefill": _gc(c.url)}
        specs = random_requests(args.requests, args.prompt, args.output, random.Random(args.seed), pool)
        arrivals = arrival_times(len(specs), args.rate, "poisson", random.Random(args.seed + 1))
        results, wall = asyncio.run(send_requests(config, specs, arrivals=arrivals))
        after = {"decode": _gc(c.decodes[0].url), "prefill": _gc(c.url)}
    figures = run_figures(summarize(results, wall), results)
    out = {"frozen": frozen, "tpot_mean": figures["tpot_mean"], "itl_p50": figures["itl_p50"],
           "itl_p99": figures["itl_p99"], "failed": figures["failed"]}
    for role in ("decode", "prefill"):
        out[f"{role}_gc_full"] = after[role][0] - before[role][0]
        out[f"{role}_gc_s"] = after[role][1] - before[role][1]
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--rate", type=float, default=0.4, help="Poisson rate, req/s")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    model = str(peer_model(MODEL_CACHE, "peer", 4096))
    pool = tokenizer_prompt_ids(model)
    runs = []
    for r in range(args.rounds):
        for frozen in ((False, True) if r % 2 == 0 else (True, False)):
            runs.append(one_run(frozen, model, pool, args, f"gcfreeze-{r}-{int(frozen)}"))
    keys = ("tpot_mean", "itl_p50", "itl_p99", "decode_gc_full", "decode_gc_s", "prefill_gc_full", "prefill_gc_s")
    med = {f: {k: statistics.median(r[k] for r in runs if r["frozen"] == f) for k in keys} for f in (False, True)}
    print(f"{'':16}{'not frozen':>12}{'frozen':>12}{'ratio':>8}")
    for k in keys:
        a, b = med[False][k], med[True][k]
        print(f"{k:16}{a:12.4g}{b:12.4g}{(b / a if a else float('nan')):8.2f}")


if __name__ == "__main__":
    main()
