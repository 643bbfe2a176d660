"""Experiment 4, prioritised chunked KV transmission vs FIFO on a shaped link.

Prefill and decode sit in two network namespaces joined by a veth pair shaped with
``tc`` (token bucket) to each rate in ``--rates-mbit`` (default 1000 and 100 Mbit/s). A
Poisson mix of short and long prompts flows through; each long prompt's KV takes a long
time on the wire. With FIFO a short request's layers queue behind every long layer
already waiting; the prioritised scheduler (MoLink: short transfers first, large ones in
chunks, a waiting-weight bound against starvation) sends them first. Both schedulers get
the same requests at the same times on a fresh cluster; the arrival rate is set so that
rate x mean idle TTFT (measured on the FIFO cluster first) equals ``--load``. The model is ``wire`` by
default (8 KiB of KV per token and layer for little compute). The load generator runs inside the prefill's namespace.
Figure: P99 TTFT of the short requests. Target: prioritised <= 0.6x FIFO.
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

from pdserve.bench.loadgen_report import percentile
from pdserve.bench.loadgen_workload import RequestSpec, arrival_times, make_prompt_ids

from pdserve.defaults import BLOCK_SIZE
from pdserve.engine import blocks_needed

from . import report
from .client import send
from .cluster import start_decode, start_prefill
from .launcher import LOG_ROOT, MODEL_CACHE, PROMPT_VOCAB, Launcher, bench_model
from .netns import LinkedNamespaces

TARGET = 0.6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="wire", help="tiny | small | medium | wire | a checkpoint directory")
    parser.add_argument("--rates-mbit", default="1000,100", help="link rates to test, Mbit/s, comma separated")
    parser.add_argument("--requests", type=int, default=50, help="requests per scheduler and rate")
    parser.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (default: from --load)")
    parser.add_argument("--load", type=float, default=0.4,
                        help="offered load: arrival rate x mean idle TTFT (measured on the FIFO cluster before "
                             "its run: compute and wire in one service time)")
    parser.add_argument("--long-fraction", type=float, default=0.2, help="fraction of long prompts")
    parser.add_argument("--long-prompt", type=int, default=1024, help="tokens of a long prompt")
    parser.add_argument("--short-prompt", type=int, default=64, help="tokens of a short prompt")
    parser.add_argument("--output", type=int, default=4, help="output tokens of every request")
    parser.add_argument("--order", choices=["fifo,priority", "priority,fifo"], default="fifo,priority",
                        help="which scheduler runs first (the first one also calibrates the arrival rate)")
    parser.add_argument("--name", default="transmission", help="file name stem of the JSON and PNG")
    parser.add_argument("--out", type=Path, default=Path("bench-results/experiments"), help="output directory")


def kv_bytes_per_token(model: str) -> int:
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.loader import tiny_config

    cfg = tiny_config() if model == "tiny" else ModelConfig.from_file(Path(model) / "config.json")
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # K and V, float32


def workload(args, rate: float) -> tuple[list[RequestSpec], list[float]]:
    rng = random.Random(5)
    specs = []
    for _ in range(args.requests):
        p = args.long_prompt if rng.random() < args.long_fraction else args.short_prompt
        specs.append(RequestSpec(p, args.output, prompt_ids=make_prompt_ids(p, rng, PROMPT_VOCAB)))
    return specs, arrival_times(len(specs), rate, "poisson", random.Random(6))


def one_run(args, model: str, rate_mbit: float, scheduler: str,
            workload_: tuple | None) -> tuple[dict, tuple, float | None]:
    """Measure one scheduler on a fresh shaped link. Without a workload (the first run of a
    rate), calibrate the arrival rate first and build the workload; return it for the next run."""
    max_len = max(args.long_prompt, args.short_prompt) + args.output + 64
    blocks = 4 * blocks_needed(max_len, BLOCK_SIZE) * 4
    service = None
    with LinkedNamespaces(rate_mbit) as link, \
            Launcher(LOG_ROOT / f"transmission-{int(rate_mbit)}-{scheduler}") as launcher:
        decode = start_decode(launcher, "decode", model, threads=1, cpus="1", num_blocks=blocks, max_model_len=max_len,
                              host=link.decode_ip, netns=link.decode_ns)
        prefill = start_prefill(launcher, "prefill", model, [decode], threads=1, cpus="0", num_blocks=blocks,
                                max_model_len=max_len, netns=link.prefill_ns, extra=["--scheduler", scheduler])
        rng = random.Random(7)
        warm = [RequestSpec(n, args.output, prompt_ids=make_prompt_ids(n, rng, PROMPT_VOCAB))
                for n in (args.short_prompt, args.long_prompt, args.short_prompt, args.long_prompt, args.short_prompt)]
        calib, _ = send(prefill.url, warm, concurrency=1, netns=link.prefill_ns)  # warm-up, and idle service times
        if workload_ is None:
            if any(not r.ok for r in calib):
                raise RuntimeError(f"calibration request failed: {[r.error for r in calib if not r.ok][0]}")
            t_short = statistics.median(r.ttft for r in calib[2::2])
            t_long = calib[3].ttft
            service = args.long_fraction * t_long + (1 - args.long_fraction) * t_short
            workload_ = workload(args, args.rate or args.load / service)
        specs, arrivals = workload_
        results, wall = send(prefill.url, specs, arrivals=arrivals, netns=link.prefill_ns)
    short = [r.ttft for r in results if r.ok and r.prompt_tokens == args.short_prompt]
    long_ = [r.ttft for r in results if r.ok and r.prompt_tokens == args.long_prompt]
    return ({"short_ttft_p50_ms": _ms(percentile(short, 50)), "short_ttft_p99_ms": _ms(percentile(short, 99)),
             "long_ttft_p50_ms": _ms(percentile(long_, 50)), "long_ttft_p99_ms": _ms(percentile(long_, 99)),
             "failed": sum(not r.ok for r in results), "errors": [r.error for r in results if not r.ok][:5],
             "wall_s": wall, "short_ttft_s": short, "long_ttft_s": long_}, workload_, service)


def _ms(v):
    return None if v is None else round(v * 1000, 1)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        rates = [float(x) for x in args.rates_mbit.split(",")]
    except ValueError:
        raise SystemExit(f"--rates-mbit must be comma-separated numbers, got {args.rates_mbit!r}")
    if not 0 < args.load < 1:
        raise SystemExit("--load must be in (0, 1)")
    model = bench_model(MODEL_CACHE, args.model)
    per_token = kv_bytes_per_token(model)
    results: dict[str, dict] = {}
    rows = []
    for mbit in rates:
        first, second = args.order.split(",")
        runs = {}
        runs[first], wl, service = one_run(args, model, mbit, first, None)
        runs[second], _, _ = one_run(args, model, mbit, second, wl)
        arrivals = wl[1]
        rate = args.rate or args.load / service
        results[f"{mbit:g}mbit"] = {"request_rate": rate, "idle_service_s": service, "arrivals_s": arrivals, **runs}
        r = report.ratio(runs["priority"]["short_ttft_p99_ms"], runs["fifo"]["short_ttft_p99_ms"])
        rows.append({"link_mbit": mbit, "request_rate": round(rate, 3),
                     "fifo_short_ttft_p99_ms": runs["fifo"]["short_ttft_p99_ms"],
                     "priority_short_ttft_p99_ms": runs["priority"]["short_ttft_p99_ms"],
                     "ratio": None if r is None else round(r, 3), "met": r is not None and r <= TARGET,
                     "fifo_long_ttft_p99_ms": runs["fifo"]["long_ttft_p99_ms"],
                     "priority_long_ttft_p99_ms": runs["priority"]["long_ttft_p99_ms"],
                     "failed": runs["fifo"]["failed"] + runs["priority"]["failed"]})
    png = plot(results, out / f"{args.name}.png")
    figures = {"rows": rows, "target": TARGET, "kv_bytes_per_token": per_token}
    path = report.save(out, args.name, {"model": model, "params": {k: str(v) for k, v in vars(args).items()},
                                            "figures": figures, "plot": str(png), "runs": results})
    for row in rows:
        print("  " + ", ".join(f"{k}={v}" for k, v in row.items()))
    print(f"prioritised vs FIFO (target short P99 TTFT <= {TARGET}x FIFO): "
          + ", ".join(f"{row['link_mbit']:g} Mbit/s {'met' if row['met'] else 'MISSED'}" for row in rows))
    print(f"wrote {path} and {png}")
    return 0


def plot(results: dict, path: Path) -> Path:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, (link, runs) in zip(axes[0], results.items()):
        for sched in ("fifo", "priority"):
            report.cdf(ax, runs[sched]["short_ttft_s"], f"{sched}: short prompts")
            report.cdf(ax, runs[sched]["long_ttft_s"], f"{sched}: long prompts")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"link {link}")
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
    fig.suptitle("Experiment 4: prioritised chunked KV transmission vs FIFO")
    return report.save_figure(fig, path)
