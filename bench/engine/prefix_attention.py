"""A prefill's attention after a prefix-cache hit: ``prefix_attend`` (two flash calls merged by log-sum-exp, or
one padded causal call when the new tokens are at least ``PAD_SHORT_PREFIX`` times the cached ones, as 256:3840
is) against the masked SDPA it replaced, A B A B in one process.

    .venv/bin/python bench/engine/prefix_attention.py [--shapes 2048:2048,1024:3072,256:3840] [--heads 4:2]
        [--head-dim 64] [--rounds 7] [--dtype float32]

A shape ``CACHED:NEW`` is NEW new tokens after CACHED cached ones (the trace's later turns: a long history, a
short new message). One torch thread; the clock is this thread's CPU time (``time.thread_time``, robust on a
shared box); each round times both, in alternating order, and the ratio is the median over rounds of
new / old with its min-max. The default heads are the peer experiment's ``small`` checkpoint (4 query heads,
2 KV heads of 64), whose prefills the peer-trace experiment measures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.bench.provenance import machine
from pdserve.engine.attention import attend, causal_mask, prefix_attend


def masked(q, k, v, n_cached: int):
    """The path before prefix_attend: one SDPA call with the [new, context] boolean mask."""
    return attend(q, k, v, mask=causal_mask(q.shape[-2], k.shape[-2], None, q.device))


def timed(fn, *args) -> float:
    t0 = time.thread_time()
    fn(*args)
    return time.thread_time() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="2048:2048,1024:3072,256:3840,2048:1024",
                   help="comma-separated CACHED:NEW token counts")
    p.add_argument("--heads", default="4:2", help="QUERY_HEADS:KV_HEADS")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    a = p.parse_args()
    torch.set_num_threads(1)
    heads, kv_heads = map(int, a.heads.split(":"))
    dtype = getattr(torch, a.dtype)
    m = machine()
    print(f"{m['cpu_model']}, torch {torch.__version__}, 1 thread, {a.dtype}, {heads}/{kv_heads} heads of "
          f"{a.head_dim}, {a.rounds} rounds A B / B A; thread CPU time per call (one layer)")
    for shape in a.shapes.split(","):
        cached, new = map(int, shape.split(":"))
        g = torch.Generator().manual_seed(cached * 7 + new)
        q = torch.randn(1, heads, new, a.head_dim, generator=g).to(dtype)
        k = torch.randn(1, kv_heads, cached + new, a.head_dim, generator=g).to(dtype)
        v = torch.randn(1, kv_heads, cached + new, a.head_dim, generator=g).to(dtype)
        err = (prefix_attend(q, k, v, cached).float() - masked(q, k, v, cached).float()).abs().max().item()
        old, ours, ratios = [], [], []
        for r in range(a.rounds):
            order = (masked, prefix_attend) if r % 2 == 0 else (prefix_attend, masked)
            t = {fn: timed(fn, q, k, v, cached) for fn in order}
            old.append(t[masked])
            ours.append(t[prefix_attend])
            ratios.append(t[prefix_attend] / t[masked])
        print(f"  cached {cached:5d} new {new:5d}: masked {statistics.median(old) * 1000:7.1f} ms, prefix_attend "
              f"{statistics.median(ours) * 1000:7.1f} ms, ratio {statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}); max |difference| {err:.1e}")


if __name__ == "__main__":
    main()
