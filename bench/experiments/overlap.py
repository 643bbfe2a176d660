"""Experiment 2, layer-wise overlap: TTFT of P/D vs prefill alone, prompts of 1K-8K tokens.

"Prefill alone" is the colocated engine (``pdserve prefill --local-fallback``, no decode):
its first token needs no KV transfer. P/D sends each layer's KV as soon as it is written
and answers the first token only when every layer has arrived, so its TTFT is prefill
plus whatever part of the transfer did not hide behind compute. Both prefills run pinned
to CPU 0 with one torch thread; the decode runs on CPU 1. All configurations are started
at once and requests go one at a time, rotating through the configurations (the same
prompt to each), so the load of a shared machine drifts over all of them alike.

Overlap off: the prefill server flag given by ``--overlap-off-flag`` (sending all layers
after the forward pass); when ``pdserve prefill --help`` does not list it, that
configuration is skipped and reported as unavailable.

``--link-mbit`` puts prefill and decode in two network namespaces joined by a veth pair
shaped to that rate (as in experiment 4), so the transfer is no longer negligible.
Target: P/D TTFT with overlap <= 1.10x prefill alone.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
from contextlib import ExitStack
from pathlib import Path

from pdserve.bench.loadgen_workload import RequestSpec, make_prompt_ids

from pdserve.defaults import BLOCK_SIZE
from pdserve.engine import blocks_needed

from . import report
from .client import send
from .cluster import start_colocated, start_decode, start_prefill
from .launcher import LOG_ROOT, MODEL_CACHE, PROMPT_VOCAB, Launcher, bench_model
from .netns import LinkedNamespaces

TARGET = 1.10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="small", help="tiny | small | medium | wire | a checkpoint directory")
    parser.add_argument("--lengths", default="1024,2048,4096,8192", help="prompt lengths in tokens, comma separated")
    parser.add_argument("--repeats", type=int, default=3, help="requests per length and configuration (median taken)")
    parser.add_argument("--overlap-off-flag", default="--no-layerwise-push",
                        help="prefill server flag that turns layer-wise overlap off")
    parser.add_argument("--link-mbit", type=float, default=None,
                        help="put prefill and decode in two namespaces joined by a link shaped to this rate")
    parser.add_argument("--out", type=Path, default=Path("bench-results/experiments"), help="output directory")


def _interleaved_ttfts(targets: dict[str, tuple[str, str | None]], lengths: list[int], repeats: int) -> dict:
    """Median-ready TTFTs per configuration and length, sending one request at a time and
    rotating through the configurations, so slow drifts of a shared machine hit all alike."""
    rng = random.Random(1)
    for url, ns in targets.values():  # warm-up
        send(url, [RequestSpec(lengths[0], 2, prompt_ids=make_prompt_ids(lengths[0], rng, PROMPT_VOCAB))],
             concurrency=1, netns=ns)
    out: dict[str, dict[int, list[float]]] = {name: {n: [] for n in lengths} for name in targets}
    for rep in range(repeats):
        for n in lengths:
            spec = RequestSpec(n, 2, prompt_ids=make_prompt_ids(n, rng, PROMPT_VOCAB))  # same prompt for all
            names = list(targets) if rep % 2 == 0 else list(reversed(targets))
            for name in names:
                url, ns = targets[name]
                (r,), _ = send(url, [spec], concurrency=1, netns=ns)
                if not r.ok:
                    raise RuntimeError(f"{name}: a {n}-token request failed: {r.error}")
                out[name][n].append(r.ttft)
        print(f"overlap: repeat {rep + 1}/{repeats} done", flush=True)
    return out


def flag_available(flag: str) -> bool:
    import sys
    from pathlib import Path as P

    out = subprocess.run([str(P(sys.executable).parent / "pdserve"), "prefill", "--help"], capture_output=True,
                         text=True).stdout
    return flag.split("=")[0] in out


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        lengths = sorted(int(x) for x in args.lengths.split(","))
    except ValueError:
        raise SystemExit(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    if not lengths or lengths[0] < 1 or args.repeats < 1:
        raise SystemExit("--lengths must be >= 1 and --repeats >= 1")
    model = bench_model(MODEL_CACHE, args.model)
    max_len = lengths[-1] + 64
    blocks = 2 * blocks_needed(max_len, BLOCK_SIZE) + 8
    configs = {"alone": None, "overlap_on": []}
    if flag_available(args.overlap_off_flag):
        configs["overlap_off"] = [args.overlap_off_flag]
    with ExitStack() as stack:
        targets: dict[str, tuple[str, str | None]] = {}
        for i, (name, extra) in enumerate(configs.items()):
            launcher = stack.enter_context(Launcher(LOG_ROOT / f"overlap-{name}"))
            if extra is None:
                cluster = start_colocated(launcher, model, threads=1, cpus="0", num_blocks=blocks,
                                          max_model_len=max_len)
                targets[name] = (cluster.url, None)
                continue
            ns_p = ns_d = None
            host = "127.0.0.1"
            if args.link_mbit:
                link = stack.enter_context(LinkedNamespaces(args.link_mbit, prefix=f"pdo{i}", subnet=200 + i))
                ns_p, ns_d, host = link.prefill_ns, link.decode_ns, link.decode_ip
            decode = start_decode(launcher, "decode", model, threads=1, cpus="1", num_blocks=blocks,
                                  max_model_len=max_len, host=host, netns=ns_d)
            prefill = start_prefill(launcher, "prefill", model, [decode], threads=1, cpus="0", num_blocks=blocks,
                                    max_model_len=max_len, netns=ns_p, extra=extra)
            targets[name] = (prefill.url, ns_p)
        measured = _interleaved_ttfts(targets, lengths, args.repeats)
    rows = []
    for n in lengths:
        alone = statistics.median(measured["alone"][n])
        row = {"prompt_tokens": n, "alone_ttft_ms": round(alone * 1000, 1)}
        for name in configs:
            if name == "alone":
                continue
            v = statistics.median(measured[name][n])
            row[f"{name}_ttft_ms"] = round(v * 1000, 1)
            row[f"{name}_ratio"] = round(v / alone, 3)
        rows.append(row)
    worst_on = max(r["overlap_on_ratio"] for r in rows)
    figures = {"rows": rows, "worst_ratio_overlap_on": worst_on, "target": TARGET, "met": worst_on <= TARGET,
               "overlap_off": "measured" if "overlap_off" in configs
               else f"unavailable: pdserve prefill has no {args.overlap_off_flag}",
               "link": f"{args.link_mbit} Mbit/s veth between namespaces" if args.link_mbit else "loopback"}
    name = f"overlap-{args.link_mbit:g}mbit" if args.link_mbit else "overlap"
    png = plot(rows, configs, out / f"{name}.png", figures["link"])
    path = report.save(out, name, {"model": model, "params": {k: str(v) for k, v in vars(args).items()},
                                       "figures": figures, "plot": str(png),
                                       "ttft_s": {k: {str(n): v for n, v in d.items()} for k, d in measured.items()}})
    for r in rows:
        print("  " + ", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"layer-wise overlap: worst TTFT ratio P/D/alone {worst_on} (target <= {TARGET}): "
          f"{'met' if figures['met'] else 'MISSED'}; overlap off: {figures['overlap_off']}")
    print(f"wrote {path} and {png}")
    return 0


def plot(rows: list[dict], configs: dict, path: Path, link: str) -> Path:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = [r["prompt_tokens"] for r in rows]
    axes[0].plot(xs, [r["alone_ttft_ms"] for r in rows], "o-", label="prefill alone")
    for name in configs:
        if name != "alone":
            axes[0].plot(xs, [r[f"{name}_ttft_ms"] for r in rows], "o-", label=f"P/D {name.replace('_', ' ')}")
            axes[1].plot(xs, [r[f"{name}_ratio"] for r in rows], "o-", label=f"P/D {name.replace('_', ' ')}")
    axes[1].axhline(TARGET, color="red", ls="--", label=f"target {TARGET}x")
    axes[1].axhline(1.0, color="gray", lw=0.8)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("TTFT (ms, median)")
    axes[1].set_ylabel("TTFT / prefill alone")
    fig.suptitle(f"Experiment 2: layer-wise overlap ({link})")
    return report.save_figure(fig, path)
