"""pdserve alone in one peer cell: how much of the P99 inter-token latency is each request's first gap.

    .venv/bin/python bench/tools/peer_first_gap.py [--prompt 512] [--output 64] [--rate 0.9] [--requests 24]

pdserve streams a request's first token from the prefill and the rest from the decode, so the gap
between the first and the second token spans the handover: the decode's step in progress, then the
new request's first step. Starts pdserve's prefill (CPU 0) and decode (CPU 1) as ``pdserve bench
experiment peer`` does (the peer checkpoint, fp32, tcp, one thread each), sends the cell's Poisson
trace once, and prints the P99 of all gaps, the first gaps' median and maximum, the other gaps'
median and P99, and how many of the gaps at or above the P99 are first gaps.
"""

from __future__ import annotations

import argparse
import random
import statistics

from pdserve.bench.experiments.launcher import LOG_ROOT, Launcher
from pdserve.bench.experiments.peer import _send, start_pdserve_alone
from pdserve.bench.loadgen_workload import arrival_times, random_requests


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.99 * (len(ordered) - 1))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--rate", type=float, default=0.9, help="Poisson rate, req/s")
    p.add_argument("--requests", type=int, default=24)
    a = p.parse_args()
    with Launcher(LOG_ROOT / "peer-first-gap") as launcher:
        c, pool = start_pdserve_alone(launcher, a.prompt, a.output)
        specs = random_requests(a.requests, a.prompt, a.output, random.Random(7), pool)
        results, _ = _send(c.url, specs, arrivals=arrival_times(len(specs), a.rate, "poisson", random.Random(8)))
    ok = [r for r in results if r.ok and len(r.gaps) > 2]
    if not ok:
        raise SystemExit("no request completed with more than 2 gaps")
    first = [r.gaps[0] for r in ok]
    rest = [g for r in ok for g in r.gaps[1:]]
    every = first + rest
    top = p99(every)
    print(f"{len(ok)} of {len(results)} requests, {len(every)} gaps: P99 {top * 1000:.1f} ms; first gaps median "
          f"{statistics.median(first) * 1000:.1f} ms, max {max(first) * 1000:.1f} ms; other gaps median "
          f"{statistics.median(rest) * 1000:.1f} ms, P99 {p99(rest) * 1000:.1f} ms; "
          f"of the {sum(g >= top for g in every)} gaps at or above the P99, "
          f"{sum(g >= top for g in first)} are first gaps")


if __name__ == "__main__":
    main()
