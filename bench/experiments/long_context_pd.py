"""Long context over a KV pool, through P/D (``long-context --pd``): the same question as
long_context.py, asked of the real serving path.

One prefill (``pdserve prefill``, a pool big enough for every prompt tried) and three
``pdserve decode`` with ``--blocks`` KV blocks each. Unpooled: plain decodes. Pooled: a gManager
and ``--kv-pool`` on every decode, each lending up to all but ``--reserve`` of its blocks. Each
request goes through the prefill's gRPC Generate (greedy, ``--max-tokens`` generated, EOS
ignored), one at a time:

1. the longest prompt that completes (binary search), unpooled and pooled; target: pooled
   >= 2.5x unpooled;
2. end-to-end tokens/s (prompt computed, then every token streamed back to the client) at the
   unpooled limit (both ways: the pooled cluster serves it without borrowing), at twice it and
   at the pooled limit (pooled only), medians of ``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import grpc

from pdserve.net import free_port
from pdserve.protos import generate_pb2 as gpb
from pdserve.protos import generate_pb2_grpc as gpb_grpc

from . import report
from .kvpool_cluster import long_prompt
from .launcher import LOG_ROOT, MODEL_CACHE, Launcher, bench_model

TARGET = 2.5
NOT_SERVED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


@contextmanager
def pd_cluster(model: str, blocks: int, block_size: int, reserve: int, pooled: bool, tag: str):
    """A prefill and three decodes (with a gManager and --kv-pool when ``pooled``): yields the
    prefill's gRPC address."""
    with Launcher(LOG_ROOT / f"long-context-pd-{tag}") as launcher:
        common = ["--model", model, "--block-size", str(block_size), "--threads", "1"]
        pool_args: list[str] = []
        if pooled:
            gm = free_port()
            launcher.start("gmanager", ["kvpool", "gmanager", "--port", str(gm)])
            pool_args = ["--kv-pool", f"127.0.0.1:{gm}", "--kv-pool-lend-fraction", str((blocks - reserve) / blocks)]
        decodes = []
        for i in range(3):
            grpc_port, http_port = free_port(), free_port()
            extra = ([*pool_args, "--kv-pool-port", str(free_port()), "--kv-pool-instance-id", f"decode-{i}"]
                     if pooled else [])
            proc = launcher.start(f"decode-{i}", ["decode", "--port", str(grpc_port), "--http-port", str(http_port),
                                                  "--kv-port", str(free_port()), "--num-blocks", str(blocks), *common,
                                                  *extra])
            decodes.append((proc, http_port, f"127.0.0.1:{grpc_port}"))
        for proc, http_port, _ in decodes:
            launcher.wait_ready(proc, f"http://127.0.0.1:{http_port}/ready")
        http_port, grpc_port = free_port(), free_port()
        prefill = launcher.start("prefill", ["prefill", "--port", str(http_port), "--grpc-port", str(grpc_port),
                                             "--decode", ",".join(a for _, _, a in decodes),
                                             "--num-blocks", str(4 * 3 * blocks), "--no-resume", *common])
        launcher.wait_ready(prefill, f"http://127.0.0.1:{http_port}/ready")
        time.sleep(2.0)  # every decode heard its peers' room, the prefill heard every decode's
        yield f"127.0.0.1:{grpc_port}"


def generate(address: str, n: int, max_tokens: int, seed: int) -> tuple[int, float]:
    """(tokens streamed back, seconds end to end); raises grpc.RpcError when not served."""

    request = gpb.GenerateRequest(prompt_token_ids=long_prompt(n, seed), max_tokens=max_tokens, temperature=0.0,
                                  ignore_eos=True, request_id=f"lc-{n}-{seed}")
    t0 = time.perf_counter()
    with grpc.insecure_channel(address) as channel:
        got = sum(len(r.token_ids) for r in gpb_grpc.GeneratorStub(channel).Generate(request, timeout=600))
    return got, time.perf_counter() - t0


def longest(address: str, max_tokens: int, upper: int) -> int:
    lo, hi = 0, upper  # lo completes (0: vacuous), hi + 1 does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            ok = generate(address, mid, max_tokens, mid)[0] == max_tokens
        except grpc.RpcError as e:
            if e.code() not in NOT_SERVED:
                raise
            ok = False
        if ok:
            lo = mid
        else:
            hi = mid - 1
    return lo


def speed(address: str, n: int, max_tokens: int, repeats: int) -> float:
    """Median end-to-end tokens/s of a prompt of ``n`` tokens."""
    rates = []
    for rep in range(repeats):
        got, seconds = generate(address, n, max_tokens, 1000 + rep)
        rates.append(got / seconds)
    return round(statistics.median(rates), 2)


def run(args: argparse.Namespace) -> int:
    model = bench_model(MODEL_CACHE, args.model)
    bs, upper = args.block_size, 3 * args.blocks * args.block_size
    with pd_cluster(model, args.blocks, bs, args.reserve, False, "unpooled") as address:
        unpooled = longest(address, args.max_tokens, upper)
        print(f"long-context --pd: unpooled longest prompt {unpooled} tokens", flush=True)
        unpooled_speed = speed(address, unpooled, args.max_tokens, args.repeats) if unpooled else None
    with pd_cluster(model, args.blocks, bs, args.reserve, True, "pooled") as address:
        pooled = longest(address, args.max_tokens, upper)
        print(f"long-context --pd: pooled longest prompt {pooled} tokens", flush=True)
        speeds = {"unpooled_limit_unpooled_e2e_tok_s": unpooled_speed,
                  "unpooled_limit_pooled_cluster_e2e_tok_s": speed(address, unpooled, args.max_tokens, args.repeats)
                  if unpooled else None,
                  # 2x: the prefill pushes the prompt's KV to the decode and its lenders; at the limit the
                  # decode computes it (whole blocks are one short there)
                  "2x_unpooled_limit_pooled_e2e_tok_s": speed(address, 2 * unpooled, args.max_tokens, args.repeats)
                  if 0 < 2 * unpooled <= pooled else None,
                  "pooled_limit_pooled_e2e_tok_s": speed(address, pooled, args.max_tokens, args.repeats)
                  if pooled else None}
    ratio = round(pooled / unpooled, 3) if unpooled else None
    figures = {"path": "P/D: pdserve prefill + 3 pdserve decode (--kv-pool)", "unpooled_longest_prompt": unpooled,
               "pooled_longest_prompt": pooled, "ratio": ratio, "target": TARGET, **speeds,
               "met": bool(unpooled) and pooled / unpooled >= TARGET,
               "prefill": "the prefill computes a pooled request's prompt and pushes each part of its KV over the "
                          "CacheStore to the decode or lender holding it; when whole blocks do not fit (one block "
                          "short, e.g. at the pooled limit) the decode computes the prompt and puts the overflow on "
                          "its lenders (PutKV)"}
    path = report.save(args.out, "long-context-pd",
                       {"model": model, "params": {k: str(v) for k, v in vars(args).items()},
                                                     "figures": figures})
    print(f"long-context --pd: longest prompt that completes through P/D: unpooled {unpooled}, pooled {pooled} tokens "
          f"({ratio}x; target >= {TARGET}: {'met' if figures['met'] else 'MISSED'}); end-to-end tokens/s: {speeds}")
    print(f"wrote {path}")
    return 0
