"""Experiment 9, prefix-cache tiers (issue 14): multi-turn chat whose working set is 4x the KV pool.

One prefill and one decode, both with the same small pool. Conversations each have their own
system prompt; turn t of every conversation is sent before turn t+1 of any (round robin, one
request at a time), so every turn comes back to a history last touched ``conversations - 1``
requests ago: with the working set (every conversation's last prompt) ``--working-set`` x the
pool, a pool alone has evicted it (LRU over a cycle larger than the cache). Two arms, each on a
fresh cluster with the same conversations, alternating (A B A B):

- ``no-tiers``  the pools alone: an evicted history is computed again
- ``tiers``     both servers keep evicted blocks in host memory (``--host-x`` x the pool) then
                on disk (``--disk-x`` x the pool) and copy them back on a prefix hit

Figures per arm (medians over the repeats): prompt tokens the prefill computed
(``pdserve_prompt_tokens_computed_total``) and the decode computed, TTFT P50/P99 at the client
(turns after the first, where a history exists, and all), KV bytes moved prefill -> decode,
tier hits / bytes / seconds per server and tier, and whether every run gave the same greedy
tokens. Target: >= 50% fewer prefill tokens with tiers, lower P50 TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from pdserve.bench.loadgen_report import percentile
from pdserve.protos import generate_pb2 as gpb
from pdserve.protos import generate_pb2_grpc as gpb_grpc

from . import report
from .cluster import start_pd
from .launcher import LOG_ROOT, MODEL_CACHE, PROMPT_VOCAB, Launcher, bench_model, metric_sum, scrape

ARMS = ("no-tiers", "tiers")
TIER_COUNTERS = ("pdserve_kv_tier_hits_total", "pdserve_kv_tier_moved_bytes_total",
                 "pdserve_kv_tier_move_seconds_total", "pdserve_kv_tier_checksum_mismatches_total")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="small", help="tiny | small | medium | wire | a checkpoint directory")
    parser.add_argument("--conversations", type=int, default=8, help="conversations, turns sent round robin")
    parser.add_argument("--turns", type=int, default=5, help="turns per conversation")
    parser.add_argument("--system-tokens", type=int, default=192, help="tokens of each conversation's system prompt")
    parser.add_argument("--user-tokens", type=int, default=64, help="tokens of each user message")
    parser.add_argument("--output-tokens", type=int, default=24, help="tokens of each answer (greedy, ignore_eos)")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size of both servers")
    parser.add_argument("--working-set", type=float, default=4.0, help="working set / pool (sets --num-blocks)")
    parser.add_argument("--host-x", type=float, default=1.0, help="host tier budget, in pools")
    parser.add_argument("--disk-x", type=float, default=4.0, help="disk tier budget, in pools")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of both arms, alternating (A B A B)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per server")
    parser.add_argument("--out", type=Path, default=Path("bench-results/experiments"), help="output directory")


def conversations(args) -> list[tuple[list[int], list[list[int]]]]:
    """(system prompt, user messages) per conversation: distinct token ids, fixed by the seed."""
    rng = random.Random(11)
    ids = lambda n: [rng.randrange(1, PROMPT_VOCAB) for _ in range(n)]  # noqa: E731
    return [(ids(args.system_tokens), [ids(args.user_tokens) for _ in range(args.turns)])
            for _ in range(args.conversations)]


def working_set_tokens(args) -> int:
    """Every conversation's last prompt: its system prompt, every user message and every answer but the last."""
    last = args.system_tokens + args.turns * args.user_tokens + (args.turns - 1) * args.output_tokens
    return args.conversations * last


def block_bytes(model: str, block_size: int) -> int:
    """One KV block of every layer, K and V, float32 (what the servers' tiers store per block)."""
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.loader import tiny_config

    cfg = tiny_config() if model == "tiny" else ModelConfig.from_file(Path(model) / "config.json")
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * 4


async def chat(address: str, convs, args) -> dict:
    """Round robin over conversations, one request at a time: (conversation, turn) -> (TTFT s, tokens)."""
    results: dict = {}
    histories = [list(system) for system, _ in convs]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gpb_grpc.GeneratorStub(channel)
        for turn in range(args.turns):
            for c, (_, users) in enumerate(convs):
                prompt = histories[c] + users[turn]
                request = gpb.GenerateRequest(prompt_token_ids=prompt, max_tokens=args.output_tokens, temperature=0,
                                              ignore_eos=True, request_id=f"c{c}-t{turn}")
                t0, ttft, answer = time.perf_counter(), None, []
                async for resp in stub.Generate(request, timeout=600):
                    if ttft is None and resp.token_ids:
                        ttft = time.perf_counter() - t0
                    answer += list(resp.token_ids)
                results[(c, turn)] = (ttft, answer)
                histories[c] = prompt + answer
    return results


def run_arm(args, arm: str, model: str, num_blocks: int, convs, run: int) -> dict:
    pool_bytes = num_blocks * block_bytes(model, args.block_size)
    disk_root = Path(tempfile.mkdtemp(prefix=f"pdserve-tiers-{arm}-"))
    flags = {"prefill": ["--block-size", str(args.block_size)], "decode": ["--block-size", str(args.block_size)]}
    if arm == "tiers":
        for role in flags:
            flags[role] += ["--kv-host-tier-bytes", str(int(args.host_x * pool_bytes)),
                            "--kv-disk-tier-dir", str(disk_root / role),
                            "--kv-disk-tier-bytes", str(int(args.disk_x * pool_bytes))]
    try:
        with Launcher(LOG_ROOT / f"tiers-{arm}-{run}") as launcher:
            cluster = start_pd(launcher, model, 1, prefill_threads=args.threads, decode_threads=args.threads,
                               num_blocks=num_blocks, prefill_extra=flags["prefill"], decode_extra=flags["decode"])
            started = time.perf_counter()
            results = asyncio.run(chat(cluster.prefill.grpc, convs, args))
            wall = time.perf_counter() - started
            prefill, decode = scrape(cluster.prefill.metrics_url), scrape(cluster.decodes[0].metrics_url)
        leftover = [str(p) for p in disk_root.rglob("*") if p.is_file()]  # the servers delete their tier files
    finally:
        shutil.rmtree(disk_root, ignore_errors=True)
    later = [t for (c, turn), (t, _) in results.items() if turn > 0]
    every = [t for t, _ in results.values()]
    tiers = {f"{role}:{name.removeprefix('pdserve_kv_tier_')}:{tier}": metric_sum(s, name, tier=tier)
             for role, s in (("prefill", prefill), ("decode", decode))
             for name in TIER_COUNTERS for tier in ("host", "disk")}
    return {
        "prefill_tokens_computed": metric_sum(prefill, "pdserve_prompt_tokens_computed_total"),
        "decode_blocks_computed": metric_sum(decode, "pdserve_kv_prompt_blocks_total", source="computed"),
        "decode_blocks_reused": metric_sum(decode, "pdserve_kv_prompt_blocks_total", source="reused"),
        "kv_bytes_moved": metric_sum(prefill, "pdserve_kv_transfer_bytes_total"),
        "ttft_p50_ms": _ms(percentile(later, 50)), "ttft_p99_ms": _ms(percentile(later, 99)),
        "ttft_all_p50_ms": _ms(percentile(every, 50)), "wall_s": round(wall, 2), "tiers": tiers,
        "tier_files_left": leftover, "ttft_s": later,
        "answers": {f"{c}/{t}": a for (c, t), (_, a) in sorted(results.items())},
    }


def _ms(v):
    return None if v is None else round(v * 1000, 1)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = bench_model(MODEL_CACHE, args.model)
    ws = working_set_tokens(args)
    num_blocks = max(1, round(ws / args.working_set / args.block_size))
    longest = args.system_tokens + args.turns * (args.user_tokens + args.output_tokens)
    if -(-longest // args.block_size) > num_blocks:
        raise SystemExit(f"pdserve: the pool ({num_blocks} blocks) cannot hold one conversation ({longest} tokens): "
                         "more conversations or a smaller --working-set")
    convs = conversations(args)
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for r in range(args.repeats):
        for arm in ARMS:  # A B A B
            runs[arm].append(run_arm(args, arm, model, num_blocks, convs, r))
            last = runs[arm][-1]
            print(f"  round {r + 1} {arm:>8}: prefill computed {last['prefill_tokens_computed']:.0f} tokens, "
                  f"TTFT p50 {last['ttft_p50_ms']} ms p99 {last['ttft_p99_ms']} ms, wall {last['wall_s']} s",
                  flush=True)
    med = {arm: {k: _round(_median([r[k] for r in rs])) for k in ("prefill_tokens_computed", "decode_blocks_computed",
                                                           "decode_blocks_reused", "kv_bytes_moved", "ttft_p50_ms",
                                                           "ttft_p99_ms", "ttft_all_p50_ms", "wall_s")}
           for arm, rs in runs.items()}
    base, tiered = med["no-tiers"], med["tiers"]
    token_ratio = report.ratio(tiered["prefill_tokens_computed"], base["prefill_tokens_computed"])
    ttft_ratio = report.ratio(tiered["ttft_p50_ms"], base["ttft_p50_ms"])
    reference = runs["no-tiers"][0]["answers"]
    identical = all(r["answers"] == reference for rs in runs.values() for r in rs)
    clean = all(not r["tier_files_left"] for rs in runs.values() for r in rs)
    met = token_ratio is not None and token_ratio <= 0.5 and ttft_ratio is not None and ttft_ratio < 1 and identical
    figures = {"pool_blocks": num_blocks, "working_set_tokens": ws,
               "working_set_x_pool": round(ws / (num_blocks * args.block_size), 2), "medians": med,
               "prefill_tokens_ratio_tiers_vs_none": token_ratio, "ttft_p50_ratio_tiers_vs_none": ttft_ratio,
               "tier_counters_last_run": runs["tiers"][-1]["tiers"], "greedy_identical": identical,
               "tier_files_deleted": clean, "met": met,
               "target": ">= 50% fewer prefill tokens with tiers, lower P50 TTFT (turns after the first); "
                         "same greedy tokens"}
    png = plot(runs, out / "tiers.png")
    path = report.save(out, "tiers", {"model": model, "params": {k: str(v) for k, v in vars(args).items()},
                                      "figures": figures, "plot": str(png),
                                      "runs": {a: [{k: v for k, v in r.items() if k != "answers"} for r in rs]
                                               for a, rs in runs.items()}})
    for arm in ARMS:
        m = med[arm]
        print(f"  {arm:>8} (median of {args.repeats}): prefill computed {m['prefill_tokens_computed']:.0f} tokens, "
              f"decode computed {m['decode_blocks_computed']:.0f} blocks, KV moved {m['kv_bytes_moved'] / 1e6:.2f} MB, "
              f"TTFT p50 {m['ttft_p50_ms']} ms p99 {m['ttft_p99_ms']} ms")
    hits = {k: v for k, v in runs["tiers"][-1]["tiers"].items() if "hits" in k}
    print(f"  tier hits (last tiers run): {hits}")
    print(f"pool {num_blocks} blocks, working set x{figures['working_set_x_pool']}: prefill tokens x{token_ratio:.2f}, "
          f"TTFT p50 x{ttft_ratio:.2f}, greedy identical {identical}, tier files deleted {clean}: "
          f"{'met' if met else 'MISSED'}")
    print(f"wrote {path} and {png}")
    return 0


def _round(v):
    return None if v is None else round(v, 2)


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def plot(runs: dict, path: Path) -> Path:
    return report.bars_and_ttft_cdf(
        path, "Experiment 9: prefix-cache tiers (host, disk), multi-turn chat, working set 4x the pool",
        {n: _median([r["prefill_tokens_computed"] for r in rs]) for n, rs in runs.items()},
        "Prompt tokens the prefill computed (median)",
        {n: [t for r in rs for t in r["ttft_s"]] for n, rs in runs.items()},
        ["tab:gray", "tab:blue"], bar_ylabel="prompt tokens", ttft_label="TTFT (ms), turns after the first")
