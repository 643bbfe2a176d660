"""Experiment 1, decode isolation: P99 time between tokens of P/D vs the colocated engine.

Same total cores for both: P/D runs one prefill process pinned to CPU 0 and one decode
process pinned to CPU 1 (one torch thread each); colocated runs one process on CPUs 0-1
with two torch threads. The workload: ``--streams`` short requests start decoding long
outputs, then ``--long-prompts`` long prompts arrive one every ``--long-every`` seconds while
they decode. In the colocated engine each long prefill shares the process (and its
steps) with the running batch, so token gaps stretch; with P/D the decode process never
runs a prefill. The figure is the P99 of the gaps between tokens of the short requests.
Target: P/D <= 0.5x colocated.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from pathlib import Path

from pdserve.bench.loadgen import LoadConfig, send_requests
from pdserve.bench.loadgen_report import percentile, summarize
from pdserve.bench.loadgen_workload import RequestSpec, make_prompt_ids

from pdserve.defaults import BLOCK_SIZE
from pdserve.engine import blocks_needed

from . import report
from .cluster import SERVED_MODEL, start_colocated, start_pd
from .launcher import LOG_ROOT, MODEL_CACHE, PROMPT_VOCAB, Launcher, bench_model

TARGET = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="small", help="tiny | small | medium | wire | a checkpoint directory")
    parser.add_argument("--streams", type=int, default=6, help="short requests decoding throughout")
    parser.add_argument("--stream-prompt", type=int, default=32, help="prompt tokens of a short request")
    parser.add_argument("--stream-output", type=int, default=256, help="output tokens of a short request")
    parser.add_argument("--long-prompts", type=int, default=6, help="long prompts arriving while the streams decode")
    parser.add_argument("--long-prompt", type=int, default=1536, help="tokens of a long prompt")
    parser.add_argument("--long-every", type=float, default=1.0, help="seconds between long prompts")
    parser.add_argument("--first-long-at", type=float, default=1.0, help="seconds after start of the first long prompt")
    parser.add_argument("--out", type=Path, default=Path("bench-results/experiments"), help="output directory")


def workload(args, vocab: int) -> tuple[list[RequestSpec], list[float], list[bool]]:
    rng = random.Random(0)
    specs, arrivals, is_stream = [], [], []
    for i in range(args.streams):
        specs.append(RequestSpec(args.stream_prompt, args.stream_output,
                                 prompt_ids=make_prompt_ids(args.stream_prompt, rng, vocab)))
        arrivals.append(0.05 * i)
        is_stream.append(True)
    for i in range(args.long_prompts):
        specs.append(RequestSpec(args.long_prompt, 2, prompt_ids=make_prompt_ids(args.long_prompt, rng, vocab)))
        arrivals.append(args.first_long_at + i * args.long_every)
        is_stream.append(False)
    return specs, arrivals, is_stream


def measure(url: str, specs, arrivals, is_stream) -> dict:
    config = LoadConfig(url=url, model=SERVED_MODEL, progress=False, request_timeout=900)
    # warm-up: one short and one long request, not measured
    asyncio.run(send_requests(config, [specs[0], specs[-1]], concurrency=1))
    results, wall = asyncio.run(send_requests(config, specs, arrivals=arrivals))
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) failed at {url}; first: {failed[0]}")
    stream_gaps = [g for r, s in zip(results, is_stream) if s and r.ok for g in r.gaps]
    return {
        "summary": summarize(results, wall),
        "stream_tbt_p50_s": percentile(stream_gaps, 50),
        "stream_tbt_p99_s": percentile(stream_gaps, 99),
        "stream_tbt_max_s": max(stream_gaps) if stream_gaps else None,
        "long_ttft_s": [r.ttft for r, s in zip(results, is_stream) if not s],
        "failed": [r.error for r in results if not r.ok],
        "stream_gaps_s": stream_gaps,
        "timeline": [[r.sent_at, r.ttft, r.gaps] for r, s in zip(results, is_stream) if s and r.ok],
    }


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = bench_model(MODEL_CACHE, args.model)
    specs, arrivals, is_stream = workload(args, PROMPT_VOCAB)
    max_len = max(args.long_prompt, args.stream_prompt + args.stream_output) + 64
    # room for every request at once (decode reserves prompt + output), so nothing is refused
    blocks = (args.streams * blocks_needed(args.stream_prompt + args.stream_output, BLOCK_SIZE)
              + args.long_prompts * blocks_needed(args.long_prompt + 2, BLOCK_SIZE) + 16)
    runs = {}
    with Launcher(LOG_ROOT / "isolation-pd") as launcher:
        cluster = start_pd(launcher, model, 1, prefill_threads=1, decode_threads=1, prefill_cpus="0", decode_cpus="1",
                           num_blocks=blocks, max_model_len=max_len)
        runs["pd"] = measure(cluster.url, specs, arrivals, is_stream)
    with Launcher(LOG_ROOT / "isolation-colocated") as launcher:
        cluster = start_colocated(launcher, model, threads=2, cpus="0,1", num_blocks=blocks, max_model_len=max_len)
        runs["colocated"] = measure(cluster.url, specs, arrivals, is_stream)
    r = report.ratio(runs["pd"]["stream_tbt_p99_s"], runs["colocated"]["stream_tbt_p99_s"])
    figures = {
        "pd_tbt_p99_ms": _ms(runs["pd"]["stream_tbt_p99_s"]),
        "colocated_tbt_p99_ms": _ms(runs["colocated"]["stream_tbt_p99_s"]),
        "pd_tbt_p50_ms": _ms(runs["pd"]["stream_tbt_p50_s"]),
        "colocated_tbt_p50_ms": _ms(runs["colocated"]["stream_tbt_p50_s"]),
        "ratio_p99_pd_over_colocated": r,
        "target": TARGET,
        "met": r is not None and r <= TARGET,
    }
    png = plot(runs, out / "isolation.png")
    path = report.save(out, "isolation", {"model": model, "params": _params(args), "figures": figures, "plot": str(png),
                                         "runs": runs})
    print(f"decode isolation: P99 TBT P/D {figures['pd_tbt_p99_ms']} ms vs colocated "
          f"{figures['colocated_tbt_p99_ms']} ms -> ratio {r if r is None else round(r, 3)} (target <= {TARGET}): "
          f"{'met' if figures['met'] else 'MISSED'}")
    print(f"wrote {path} and {png}")
    return 0


def _ms(v):
    return None if v is None else round(v * 1000, 2)


def _params(args) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def plot(runs: dict, path: Path) -> Path:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, run_ in runs.items():
        report.cdf(axes[0], run_["stream_gaps_s"], name)
    axes[0].set_xscale("log")
    axes[0].set_xlabel("time between tokens of the decoding requests (ms)")
    axes[0].set_ylabel("fraction of gaps")
    axes[0].set_title("CDF of time between tokens")
    axes[0].legend()
    axes[0].grid(True, alpha=0.3)
    for name, color in (("pd", "tab:blue"), ("colocated", "tab:orange")):
        xs, ys = [], []
        for sent, ttft, gaps in runs[name]["timeline"]:
            t = sent + ttft
            for g in gaps:
                t += g
                xs.append(t)
                ys.append(g * 1000)
        axes[1].plot(xs, ys, ".", ms=2, color=color, label=name)
    axes[1].set_yscale("log")
    axes[1].set_xlabel("time since start (s)")
    axes[1].set_ylabel("gap before token (ms)")
    axes[1].set_title("token gaps while long prompts arrive")
    axes[1].legend()
    fig.suptitle("Experiment 1: decode isolation, P/D vs colocated (same cores)")
    return report.save_figure(fig, path)
