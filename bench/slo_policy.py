"""pdserve bench slo-policy: the cost of one ordering decision of the global queue (fifo, edf,
qlm) on synthetic queues, and how many of the queued requests each order would make miss.

Queues of N waiting requests (interactive: TTFT 1 s, e2e 20 s, 20 tokens; batch-1: e2e 60 s;
batch-2: e2e 1 h; 50-400 tokens; arrivals spread over the last 30 s, more interactive ones
recently), K requests running. The estimator is primed with a per-token time and output
lengths, so every policy sees the same numbers. A decision is one ``policies.order`` call
(what ``GlobalQueue`` does when the queue changed); the time is the median of ``--repeat``.
fifo is the baseline the ratios are against.

  pdserve bench slo-policy                  # N = 10, 100, 1000
  pdserve bench slo-policy --sizes 50,500 --slots 8 --out results/
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from pdserve.slo.classes import SloClass
from pdserve.slo.estimator import Estimator, Job
from pdserve.slo.groups import Waiting
from pdserve.slo.policies import POLICIES, Context, evaluate, order

from .provenance import write_json

CLASSES = (SloClass("interactive", ttft_ms=1000, e2e_ms=20_000), SloClass("batch-1", e2e_ms=60_000),
           SloClass("batch-2", e2e_ms=3_600_000))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="10,100,1000", help="queue lengths N, comma separated")
    parser.add_argument("--slots", type=int, default=16, help="K: requests the backend serves at once")
    parser.add_argument("--per-token-ms", type=float, default=20.0, help="decode time per token")
    parser.add_argument("--repeat", type=int, default=5, help="decisions timed per policy and size (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write slo_policy.json here")


def synthetic_queue(n: int, rng: random.Random, now: float) -> list[Waiting]:
    out = []
    for seq, arrival in enumerate(sorted(now - rng.uniform(0, 30) ** 1.5 / 30 ** 0.5 for _ in range(n))):
        cls = rng.choices(CLASSES, weights=(5, 3, 2))[0]
        tokens = 20 if cls is CLASSES[0] else rng.choice([50, 100, 200, 400])
        out.append(Waiting(f"r{seq}", cls, arrival, seq, Job(cls.name, rng.randint(20, 500), tokens)))
    return out


def primed_estimator(per_token_s: float) -> Estimator:
    est = Estimator()
    est.observe_gap(0.0, 1, per_token_s)
    est.observe_prefill(100, 0.02)
    est.observe_prefill(500, 0.08)
    for cls, lengths in (("interactive", (20,)), ("batch-1", (50, 100, 200, 400)), ("batch-2", (50, 100, 200, 400))):
        for n in lengths:
            est.observe_output(cls, n)
    return est


def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    est = primed_estimator(args.per_token_ms / 1000)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    rows = []
    print(f"{'N':>6} {'policy':>6} {'decision':>12} {'x fifo':>8} {'late':>6} {'lateness s':>11}")
    for n in sizes:
        now = 1000.0
        queue = synthetic_queue(n, rng, now)
        ctx = Context(now, est, tuple(rng.uniform(0, 400 * args.per_token_ms / 1000) for _ in range(args.slots)),
                      args.slots)
        base = None
        for policy in POLICIES:
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                ordered = order(policy, queue, ctx)
                times.append(time.perf_counter() - t0)
            cost = statistics.median(times)
            base = cost if policy == "fifo" else base
            late, lateness = evaluate(ordered, ctx)
            rows.append({"n": n, "policy": policy, "decision_s": cost, "late": late, "lateness_s": lateness})
            print(f"{n:>6} {policy:>6} {cost * 1000:>10.3f}ms {cost / base:>8.1f} {late:>6} {lateness:>11.1f}")
    if args.out is not None:
        write_json(args.out / "slo_policy.json", {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
    return 0
