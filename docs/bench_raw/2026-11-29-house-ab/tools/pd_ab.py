"""Token gaps of pdserve's P/D under variants of its code or environment, alternating A B A B.

    .venv/bin/python bench/tools/pd_ab.py --variant NAME=PDSERVE[:VAR=VALUE,...] --variant ... \
        [--server-args NAME='--flag ...'] [--transfer tcp|nixl] [--rounds 2] \
        [--prompt 512 --output 64 --rate 0.4 --requests 16]

A variant is a ``pdserve`` command (this checkout's ``.venv/bin/pdserve``, or another worktree's:
the code before a change) and environment variables its servers get, e.g.
  --variant frozen=.venv/bin/pdserve --variant unfrozen=.venv/bin/pdserve:PDSERVE_GC_FREEZE=0
  --variant before=/work/wt/old/.venv/bin/pdserve --variant after=.venv/bin/pdserve --transfer nixl
  --variant off=.venv/bin/pdserve --variant on=.venv/bin/pdserve \
      --server-args off=--no-kv-checksum --server-args on=--kv-checksum
``--server-args`` gives a variant's prefill and decode more flags.
Each round starts the peer experiment's P/D pair once per variant (one prefill on CPU 0, one
decode on CPU 1, one thread each), in reverse order every other round, and sends each the same
Poisson trace of streamed requests of exactly --prompt / --output tokens. Per run it prints the
clients' TTFT and TPOT means, ITL P50/P99 and the full garbage collections decode and prefill
made while serving (``pdserve_gc_full_collection_seconds``); at the end the medians per variant
and their ratios to the first. The checkpoint is the peer experiment's (written on first use).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
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

GC = "pdserve_gc_full_collection_seconds"


def _gc(url: str) -> tuple[float, float]:
    samples = scrape(url + "/metrics")
    return metric_sum(samples, GC + "_count"), metric_sum(samples, GC + "_sum")


def one_run(variant: tuple[str, str, dict], model: str, pool: list[int], args, name: str) -> dict:
    label, pdserve, env = variant
    extra = ["--transfer", args.transfer, "--dtype", "float32", *args.server_args.get(label, [])]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the servers inherit it
    try:
        with Launcher(LOG_ROOT / name) as launcher:
            launcher.pdserve = pdserve
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
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    figures = run_figures(summarize(results, wall), results)
    out = {"variant": label, **{k: figures[k] for k in ("ttft_mean", "tpot_mean", "itl_p50", "itl_p99", "failed")}}
    for role in ("decode", "prefill"):
        out[f"{role}_gc_full"] = after[role][0] - before[role][0]
        out[f"{role}_gc_s"] = after[role][1] - before[role][1]
    print(json.dumps(out), flush=True)
    return out


def parse_variant(text: str) -> tuple[str, str, dict]:
    """NAME=PDSERVE[:VAR=VALUE,...] -> (name, pdserve command, environment)."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"--variant wants NAME=PDSERVE[:VAR=VALUE,...], got {text!r}")
    pdserve, _, env_text = rest.partition(":")
    env = {}
    for item in filter(None, env_text.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise argparse.ArgumentTypeError(f"--variant {name}: environment items are VAR=VALUE, got {item!r}")
        env[key] = value
    if not os.access(pdserve, os.X_OK):
        raise argparse.ArgumentTypeError(f"--variant {name}: {pdserve!r} is not an executable pdserve")
    return name, os.path.abspath(pdserve), env


def parse_server_args(text: str) -> tuple[str, list[str]]:
    """NAME=FLAGS -> (name, the flags split as a shell would)."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--server-args wants NAME=FLAGS, got {text!r}")
    return name, shlex.split(rest)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", type=parse_variant, action="append", required=True,
                   help="NAME=PDSERVE[:VAR=VALUE,...]; two or more, the first is the baseline of the ratios")
    p.add_argument("--server-args", type=parse_server_args, action="append", default=[],
                   help="NAME=FLAGS: more flags for that variant's prefill and decode (e.g. on=--kv-checksum)")
    p.add_argument("--transfer", choices=["tcp", "nixl"], default="tcp")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--rate", type=float, default=0.4, help="Poisson rate, req/s")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    unknown = {n for n, _ in args.server_args} - {v[0] for v in args.variant}
    if unknown:
        p.error(f"--server-args for no --variant: {sorted(unknown)}")
    args.server_args = dict(args.server_args)
    if len(args.variant) < 2 or len({v[0] for v in args.variant}) != len(args.variant):
        p.error("give two or more --variant, each with its own name")
    model = str(peer_model(MODEL_CACHE, "peer", 4096))
    pool = tokenizer_prompt_ids(model)
    runs = []
    for r in range(args.rounds):
        for v in (args.variant if r % 2 == 0 else args.variant[::-1]):
            runs.append(one_run(v, model, pool, args, f"pd-ab-{r}-{v[0]}"))
    keys = ("ttft_mean", "tpot_mean", "itl_p50", "itl_p99", "failed", "decode_gc_full", "decode_gc_s",
            "prefill_gc_full", "prefill_gc_s")
    names = [v[0] for v in args.variant]
    med = {n: {k: statistics.median(r[k] for r in runs if r["variant"] == n) for k in keys} for n in names}
    print(f"{'':16}" + "".join(f"{n:>14}" for n in names) + "".join(f"{n + '/' + names[0]:>16}" for n in names[1:]))
    for k in keys:
        base = med[names[0]][k]
        ratios = "".join(f"{(med[n][k] / base if base else float('nan')):16.2f}" for n in names[1:])
        print(f"{k:16}" + "".join(f"{med[n][k]:14.4g}" for n in names) + ratios)


if __name__ == "__main__":
    main()
