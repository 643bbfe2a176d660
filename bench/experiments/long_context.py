"""Long context over a KV pool (DistKV-LLM): the longest prompt that completes, pooled vs unpooled.

Three decodes (``pdserve kvpool node``), each with a small pool of ``--blocks`` KV blocks.
Unpooled: no gManager; a request runs on the engine's normal path of one decode. Pooled: a
gManager, and a request spills onto the other two decodes (each lends down to ``--reserve``),
with DistAttention for its decode steps. Measured, one request at a time:

1. the longest prompt that completes (binary search on the prompt length, ``--max-tokens``
   generated), unpooled and pooled. Target: pooled >= 2.5x unpooled;
2. tokens/s of long requests: decode tokens/s and end-to-end tokens/s (prefill included) at
   prompt lengths from the unpooled limit to the pooled one (unpooled where it fits);
3. decode slowdown per spilled block: one prompt that fits locally, run with 0, 1, 2, ...
   of its blocks pushed to lenders (``max_local_blocks``); decode ms/token against spilled
   blocks, and the least-squares slope.
The speed points run in one pooled cluster, rotated through in every repeat (medians), so
the load of a shared machine drifts over all of them alike; the unpooled point is the engine's
normal path on the same decode.

``--pd``: the same longest-prompt question through the P/D serving path (``pdserve decode
--kv-pool``), see long_context_pd.py.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import grpc

from pdserve.defaults import BLOCK_SIZE
from pdserve.engine import blocks_needed

from . import report
from .kvpool_cluster import KVPoolCluster, long_prompt
from .launcher import LOG_ROOT, MODEL_CACHE, bench_model

TARGET = 2.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="tiny | small | medium | a checkpoint directory")
    parser.add_argument("--blocks", type=int, default=8, help="KV blocks per decode (a small pool)")
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    parser.add_argument("--reserve", type=int, default=1, help="blocks a lender keeps for its own work")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--repeats", type=int, default=5, help="runs per speed point (median taken)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/experiments"), help="output directory")
    parser.add_argument("--pd", action="store_true",
                        help="through P/D instead: pdserve prefill + 3 pdserve decode (--kv-pool when pooled); "
                             "longest prompt and end-to-end tokens/s (long_context_pd.py)")


def _completes(cluster: KVPoolCluster, n: int, max_tokens: int, pooled: bool) -> bool:
    try:
        reply = cluster.generate("decode-0", f"probe-{pooled}-{n}", long_prompt(n, n), max_tokens, pooled=pooled)
    except grpc.RpcError as e:
        if e.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT):
            return False
        raise
    return len(reply.token_ids) == max_tokens


def longest(cluster: KVPoolCluster, max_tokens: int, pooled: bool, upper: int) -> int:
    """The longest prompt (tokens) that completes on decode-0: binary search in [1, upper]."""
    lo, hi = 0, upper  # lo completes (0: vacuous), hi + 1 does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _completes(cluster, mid, max_tokens, pooled):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _once(cluster: KVPoolCluster, n: int, tokens: int, pooled: bool, local: int, tag: str) -> dict:
    t0 = time.perf_counter()
    reply = cluster.generate("decode-0", f"speed-{tag}", long_prompt(n, 7), tokens, pooled=pooled,
                             max_local_blocks=local)
    wall = time.perf_counter() - t0
    return {"decode_ms": 1000 * reply.decode_s / (len(reply.token_ids) - 1), "e2e_tok_s": len(reply.token_ids) / wall,
            "spilled_blocks": reply.borrowed_blocks}


def measure(cluster: KVPoolCluster, points: dict[str, tuple[int, bool, int]], tokens: int, repeats: int) -> dict:
    """Medians per point (name -> (prompt tokens, pooled, max local blocks)), the points rotated
    through in every repeat so the drift of a shared machine hits them all alike."""
    runs: dict[str, list[dict]] = {name: [] for name in points}
    names = list(points)
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            n, pooled, local = points[name]
            runs[name].append(_once(cluster, n, tokens, pooled, local, f"{name}-{rep}"))
    out = {}
    for name, rs in runs.items():
        ms = statistics.median(r["decode_ms"] for r in rs)
        out[name] = {"decode_ms_per_token": round(ms, 3), "decode_tok_s": round(1000 / ms, 1),
                     "decode_ms_min": round(min(r["decode_ms"] for r in rs), 3),
                     "e2e_tok_s": round(statistics.median(r["e2e_tok_s"] for r in rs), 1),
                     "spilled_blocks": rs[-1]["spilled_blocks"]}
    return out


def _slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def spill_costs(spill_rows: list[dict]) -> dict:
    """Decode cost of spilling, from the runs with 0, 1, 2, ... blocks on a lender: the slope over
    all of them, the step of the first spilled block (a lender's round trips per layer), and the
    slope over the runs with at least one (the attention over more remote blocks)."""
    out = {"local_decode_ms_per_token": spill_rows[0]["decode_ms_per_token"],
           "local_decode_ms_min": spill_rows[0]["decode_ms_min"]}
    for suffix, key in (("", "decode_ms_per_token"), ("_from_minima", "decode_ms_min")):
        xs, ys = [r["spilled_blocks"] for r in spill_rows], [r[key] for r in spill_rows]
        out[f"slowdown_ms_per_spilled_block{suffix}"] = round(_slope(xs, ys), 4) if len(set(xs)) > 1 else None
        first = [r[key] for r in spill_rows if r["spilled_blocks"] == 1]
        out[f"first_lender_ms{suffix}"] = round(first[0] - ys[0], 3) if first else None
        more = [(x, y) for x, y in zip(xs, ys) if x >= 1]
        out[f"per_further_block_ms{suffix}"] = (round(_slope([x for x, _ in more], [y for _, y in more]), 4)
                                                if len({x for x, _ in more}) > 1 else None)
    return out


def run(args: argparse.Namespace) -> int:
    if args.blocks < 2 or args.max_tokens < 1 or args.repeats < 1 or args.reserve < 0:
        raise SystemExit("need --blocks >= 2, --max-tokens >= 1, --repeats >= 1, --reserve >= 0")
    if args.pd:
        from .long_context_pd import run as run_pd

        return run_pd(args)
    model = bench_model(MODEL_CACHE, args.model)
    bs = args.block_size
    common = dict(num_blocks=args.blocks, reserve=args.reserve, block_size=bs, model=model)
    upper = 3 * args.blocks * bs
    with KVPoolCluster(3, pooled=False, log_dir=LOG_ROOT / "long-context-unpooled", **common) as c:
        unpooled = longest(c, args.max_tokens, False, upper)
        print(f"long-context: unpooled longest prompt {unpooled} tokens", flush=True)
    with KVPoolCluster(3, pooled=True, log_dir=LOG_ROOT / "long-context-pooled", **common) as c:
        pooled = longest(c, args.max_tokens, True, upper)
        print(f"long-context: pooled longest prompt {pooled} tokens", flush=True)
        lengths = sorted({unpooled, *(int(unpooled * f) for f in (1.5, 2.0, 2.5)), pooled})
        lengths = [n for n in lengths if 0 < n <= pooled]
        # the engine's normal path on decode-0 is what an unpooled decode runs (its pool is not used)
        points = {f"pooled-{n}": (n, True, 0) for n in lengths}
        points[f"unpooled-{unpooled}"] = (unpooled, False, 0)
        # slowdown per spilled block: a prompt that fits locally, 0..k of its blocks pushed to lenders
        fit = (args.blocks - blocks_needed(args.max_tokens, bs)) * bs
        for local in range(args.blocks, 0, -1):
            points[f"spill-{local}"] = (fit, True, local)
        print(f"long-context: measuring {len(points)} points x {args.repeats} repeats, interleaved", flush=True)
        got = measure(c, points, args.max_tokens, args.repeats)
        c.wait(lambda: all(c.stats(name).free_blocks == args.blocks for name in c.ports)
               and all(row == {} for row in c.ledger().values()), "every block and debt back to zero")
    rows = [{"prompt_tokens": n, "pooled": got[f"pooled-{n}"],
             **({"unpooled": got[f"unpooled-{n}"]} if f"unpooled-{n}" in got else {})} for n in lengths]
    spill_rows = [{"local_blocks": local, **got[f"spill-{local}"]} for local in range(args.blocks, 0, -1)]
    for r in rows + spill_rows:
        print(f"  {r}", flush=True)
    figures = {"unpooled_longest_prompt": unpooled, "pooled_longest_prompt": pooled,
               "ratio": round(pooled / unpooled, 3) if unpooled else None, "target": TARGET,
               "speed": rows, "spill": spill_rows, **spill_costs(spill_rows),
               "prefill": "on the borrowing decode; it sends the overflow's KV to the lenders layer by layer (PutKV)"}
    figures["met"] = bool(unpooled) and pooled / unpooled >= TARGET
    png = plot(rows, spill_rows, args.out / "long-context.png", figures)
    path = report.save(args.out, "long-context", {"model": model, "params": {k: str(v) for k, v in vars(args).items()},
                                                  "figures": figures, "plot": str(png)})
    print(f"long-context: longest prompt that completes: unpooled {unpooled}, pooled {pooled} tokens "
          f"({figures['ratio']}x; target >= {TARGET}: {'met' if figures['met'] else 'MISSED'})")
    f = figures
    print(f"long-context: decode {f['local_decode_ms_per_token']} ms/token with no spill (fastest run "
          f"{f['local_decode_ms_min']}); spilled onto one lender: {f['slowdown_ms_per_spilled_block']:+} ms/token per "
          f"spilled block over 0..{spill_rows[-1]['spilled_blocks']} blocks (median runs; fastest runs "
          f"{f['slowdown_ms_per_spilled_block_from_minima']:+}), of which the first lender's round trips "
          f"{f['first_lender_ms']:+} (fastest {f['first_lender_ms_from_minima']:+}) and each further block "
          f"{f['per_further_block_ms']:+} (fastest {f['per_further_block_ms_from_minima']:+})")
    print(f"wrote {path} and {png}")
    return 0


def plot(rows: list[dict], spill_rows: list[dict], path: Path, figures: dict) -> Path:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = [r["prompt_tokens"] for r in rows]
    axes[0].plot(xs, [r["pooled"]["decode_tok_s"] for r in rows], "o-", label="pooled: decode tokens/s")
    axes[0].plot(xs, [r["pooled"]["e2e_tok_s"] for r in rows], "s--", label="pooled: end-to-end tokens/s")
    for r in rows:
        if r.get("unpooled"):
            axes[0].plot([r["prompt_tokens"]], [r["unpooled"]["decode_tok_s"]], "k^", label="unpooled: decode tokens/s")
    axes[0].axvline(figures["unpooled_longest_prompt"], color="grey", ls=":", label="unpooled limit")
    axes[0].set_xlabel("prompt tokens")
    axes[0].set_ylabel("tokens/s")
    axes[0].set_title(f"longest prompt: {figures['pooled_longest_prompt']} pooled vs "
                      f"{figures['unpooled_longest_prompt']} unpooled ({figures['ratio']}x)")
    axes[0].legend()
    axes[1].plot([r["spilled_blocks"] for r in spill_rows], [r["decode_ms_per_token"] for r in spill_rows], "o-")
    axes[1].set_xlabel("blocks of the request's KV on lenders")
    axes[1].set_ylabel("decode ms/token")
    axes[1].plot([r["spilled_blocks"] for r in spill_rows], [r["decode_ms_min"] for r in spill_rows], "s--",
                 label="fastest run")
    axes[1].legend(["median run", "fastest run"])
    axes[1].set_title(f"first lender {figures['first_lender_ms']:+} ms/token, "
                      f"each further block {figures['per_further_block_ms']:+}")
    return report.save_figure(fig, path)
