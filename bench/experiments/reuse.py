"""Experiment 6, decode-side prefix reuse and cost-based disaggregation on multi-turn chat.

One prefill and two decodes; conversations share a system prompt and every turn appends a
user message to the history (prompt = history + question, history += answer). The
conversations run concurrently, each turn after the previous answer. Three arms, each on a
fresh cluster with the same conversations:

- ``no-reuse``    --no-decode-reuse: every prompt block moves to the decode (the baseline)
- ``reuse``       decodes serve the cached prefix, only missing blocks move (the default)
- ``reuse+auto``  and --disaggregation auto: the cost model may have the decode compute the prompt

Figures: KV bytes moved (the prefill's pdserve_kv_transfer_bytes_total), prompt blocks by
how the decodes got them, the prefill's decisions, TTFT P50/P99 as the client sees it, and
whether every arm gave the same greedy tokens. Target: KV bytes moved with reuse <= 0.5x
no-reuse, greedy tokens identical.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import grpc

from pdserve.bench.loadgen_report import percentile
from pdserve.protos import generate_pb2 as gpb
from pdserve.protos import generate_pb2_grpc as gpb_grpc

from . import report
from .cluster import start_pd
from .launcher import LOG_ROOT, MODEL_CACHE, PROMPT_VOCAB, Launcher, bench_model, metric_sum, scrape

ARMS = {"no-reuse": ["--no-decode-reuse"], "reuse": [], "reuse+auto": ["--disaggregation", "auto"]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="tiny | small | medium | wire | a checkpoint directory")
    parser.add_argument("--conversations", type=int, default=8, help="conversations, run concurrently")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--system-prompt", type=int, default=256, help="tokens of the shared system prompt")
    parser.add_argument("--question", type=int, default=48, help="tokens of each user message")
    parser.add_argument("--answer", type=int, default=32, help="tokens of each answer (greedy, ignore_eos)")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size of every server")
    parser.add_argument("--out", type=Path, default=Path("bench-results/experiments"), help="output directory")


async def conversation(stub, cid: int, args, results: dict) -> None:
    history = [(7 * t) % (PROMPT_VOCAB - 1) + 1 for t in range(args.system_prompt)]
    for turn in range(args.turns):
        history += [(31 * cid + 17 * turn + t) % (PROMPT_VOCAB - 1) + 1 for t in range(args.question)]
        t0, ttft, answer = time.perf_counter(), None, []
        request = gpb.GenerateRequest(prompt_token_ids=history, max_tokens=args.answer, temperature=0, ignore_eos=True,
                                      request_id=f"c{cid}-t{turn}")
        async for resp in stub.Generate(request, timeout=600):
            if ttft is None and resp.token_ids:
                ttft = time.perf_counter() - t0
            answer += list(resp.token_ids)
        results[(cid, turn)] = (ttft, answer)
        history += answer


def run_arm(args, arm: str, model: str) -> dict:
    flags = ["--block-size", str(args.block_size)]
    with Launcher(LOG_ROOT / f"reuse-{arm}") as launcher:
        cluster = start_pd(launcher, model, 2, prefill_threads=1, decode_threads=1, num_blocks=512,
                           prefill_extra=flags + ARMS[arm], decode_extra=flags)

        async def main() -> dict:
            async with grpc.aio.insecure_channel(cluster.prefill.grpc) as channel:
                stub = gpb_grpc.GeneratorStub(channel)
                results: dict = {}
                await asyncio.gather(*(conversation(stub, c, args, results) for c in range(args.conversations)))
                return results

        results = asyncio.run(main())
        prefill = scrape(cluster.prefill.metrics_url)
        decodes = [scrape(d.metrics_url) for d in cluster.decodes]
    blocks = {s: sum(metric_sum(d, "pdserve_kv_prompt_blocks_total", source=s) for d in decodes)
              for s in ("reused", "moved", "computed")}
    decisions = {f"{k[0]}/{k[1]}": v for k, v in _decisions(prefill).items()}
    ttfts = [t for t, _ in results.values()]
    return {"kv_bytes_moved": metric_sum(prefill, "pdserve_kv_transfer_bytes_total"), "prompt_blocks": blocks,
            "decisions": decisions, "ttft_p50_ms": _ms(percentile(ttfts, 50)),
            "ttft_p99_ms": _ms(percentile(ttfts, 99)),
            "ttft_s": ttfts, "answers": {f"{c}/{t}": a for (c, t), (_, a) in sorted(results.items())}}


def _decisions(samples: dict) -> dict:
    out: dict = {}
    for (name, labels), value in samples.items():
        if name == "pdserve_disaggregation_decisions_total":
            d = dict(labels)
            out[(d["decision"], d["reason"])] = value
    return out


def _ms(v):
    return None if v is None else round(v * 1000, 1)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = bench_model(MODEL_CACHE, args.model)
    runs = {arm: run_arm(args, arm, model) for arm in ARMS}
    base = runs["no-reuse"]
    ratio = report.ratio(runs["reuse"]["kv_bytes_moved"], base["kv_bytes_moved"])
    identical = all(r["answers"] == base["answers"] for r in runs.values())
    met = ratio is not None and ratio <= 0.5 and identical
    figures = {arm: {k: v for k, v in r.items() if k not in ("ttft_s", "answers")} for arm, r in runs.items()}
    figures.update(kv_bytes_ratio_reuse_vs_no_reuse=ratio, greedy_identical=identical, met=met,
                   target="KV bytes moved with reuse <= 0.5x no-reuse; greedy tokens identical in every arm")
    png = plot(runs, out / "reuse.png")
    path = report.save(out, "reuse", {"model": model, "params": {k: str(v) for k, v in vars(args).items()},
                                      "figures": figures, "plot": str(png),
                                      "runs": {a: {k: v for k, v in r.items() if k != "answers"}
                                               for a, r in runs.items()}})
    for arm, r in runs.items():
        print(f"  {arm:>10}: KV moved {r['kv_bytes_moved'] / 1e6:.2f} MB, prompt blocks {r['prompt_blocks']}, "
              f"TTFT p50 {r['ttft_p50_ms']} ms p99 {r['ttft_p99_ms']} ms, decisions {r['decisions']}")
    print(f"reuse vs no-reuse: KV bytes x{ratio:.2f}, greedy identical {identical}: {'met' if met else 'MISSED'}")
    print(f"wrote {path} and {png}")
    return 0


def plot(runs: dict, path: Path) -> Path:
    return report.bars_and_ttft_cdf(
        path, "Experiment 6: decode-side prefix reuse and cost-based disaggregation (multi-turn chat)",
        {n: r["kv_bytes_moved"] / 1e6 for n, r in runs.items()}, "KV bytes moved prefill -> decodes",
        {n: r["ttft_s"] for n, r in runs.items()}, ["tab:gray", "tab:blue", "tab:green"], bar_ylabel="MB")
