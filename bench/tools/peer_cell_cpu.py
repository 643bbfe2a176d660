"""pdserve's P/D alone in one cell of the peer experiment, with where each server's CPU went.

    .venv/bin/python bench/tools/peer_cell_cpu.py [--prompt 2048] [--output 256] [--rate 0.17]
        [--requests 16] [--repeats 1]

Starts pdserve's prefill (CPU 0) and decode (CPU 1) as ``pdserve bench experiment peer`` does (same
checkpoint, flags and KV budget, tcp, fp32), warms up, sends the cell's Poisson trace once per repeat
(``peer.run_grid``), and prints the client's figures, then per server the CPU seconds it used during the
trace (all threads, and its busiest threads by /proc/<pid>/task), and the means of its latency
histograms over the trace (prefill compute, queue wait, KV transfer, decode's wait for the last layer).
A decode thread busy most of the wall time means the decode core is saturated: its steps, not the
queue, set TPOT.
"""

from __future__ import annotations

import argparse
import os
import time

from pdserve.bench.experiments.launcher import LOG_ROOT, Launcher, metric_sum, scrape
from pdserve.bench.experiments.peer import run_grid, start_pdserve_alone

HISTOGRAMS = ("pdserve_prefill_compute_seconds", "pdserve_queue_wait_seconds", "pdserve_kv_transfer_seconds",
              "pdserve_decode_last_layer_wait_seconds", "pdserve_time_between_tokens_seconds")
TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """tid -> user + system CPU seconds of each thread of pid."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out[tid] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def histograms(url: str) -> dict[str, tuple[float, float]]:
    samples = scrape(url + "/metrics")
    return {n: (metric_sum(samples, n + "_sum"), metric_sum(samples, n + "_count")) for n in HISTOGRAMS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--rate", type=float, default=0.17, help="Poisson rate, req/s")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--repeats", type=int, default=1)
    a = p.parse_args()
    args = argparse.Namespace(prompt_lens=[a.prompt], output_lens=[a.output], warmup=0, seed=0, num_requests=a.requests,
                              request_timeout=600.0)
    for repeat in range(a.repeats):
        with Launcher(LOG_ROOT / f"peer-cell-cpu-{repeat}") as launcher:
            c, pool = start_pdserve_alone(launcher, a.prompt, a.output)
            servers = {"prefill": (c.prefill.proc.popen.pid, c.prefill.url),
                       "decode": (c.decodes[0].proc.popen.pid, c.decodes[0].url)}
            before = {name: (thread_cpu(pid), histograms(url)) for name, (pid, url) in servers.items()}
            t0, load = time.monotonic(), os.getloadavg()[0]
            fig = next(iter(run_grid(c.url, [(a.prompt, a.output, a.rate)], pool, args).values()))
            wall = time.monotonic() - t0
            print(f"repeat {repeat + 1}: load {load:.2f} before; TTFT mean {fig['ttft_mean']:.2f} s, TPOT mean "
                  f"{fig['tpot_mean'] * 1000:.1f} ms, ITL P99 {fig['itl_p99'] * 1000:.0f} ms, "
                  f"{fig['output_tok_s']:.1f} tok/s, {wall:.0f} s wall")
            for name, (pid, url) in servers.items():
                cpu0, hist0 = before[name]
                used = {tid: s - cpu0.get(tid, 0.0) for tid, s in thread_cpu(pid).items()}
                top = sorted(used.values(), reverse=True)[:3]
                print(f"  {name}: {sum(used.values()):.1f} s CPU ({sum(used.values()) / wall:.0%} of the wall time); "
                      f"busiest threads {', '.join(f'{s:.1f} s' for s in top)}")
                for metric, (total, count) in histograms(url).items():
                    n = count - hist0[metric][1]
                    if n:
                        mean_ms = (total - hist0[metric][0]) / n * 1000
                        print(f"    {metric}: {n:.0f} observations, mean {mean_ms:.1f} ms")


if __name__ == "__main__":
    main()
