"""Where a lone request's TTFT goes in pdserve's P/D: client TTFT against the prefill's own metrics.

    .venv/bin/python bench/tools/ttft_parts.py [--requests 4] [--prompt 2048] [--transfer tcp]
        [--rate R --max-tokens 256]

Starts one ``pdserve decode`` pinned to CPU 1 and one ``pdserve prefill`` pinned to CPU 0, one
thread each, on the peer experiment's checkpoint (as ``pdserve bench experiment peer`` runs them;
``--model`` for another), sends ``--requests`` prompts of ``--prompt`` random token ids one after
another (streamed by ``pdserve.bench.loadgen``, ``--max-tokens`` tokens each, 8 by default), prints
each one's TTFT at the client,
then the mean of the prefill's ``pdserve_time_to_first_token_seconds``, ``pdserve_prefill_compute_seconds``
and ``pdserve_queue_wait_seconds`` over the same requests. With ``--rate`` the requests arrive as a
Poisson process at that many per second instead (overlapping, as under the peer experiment's trace), so
the prefill's compute under load can be set beside its compute alone. Stops both servers on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pdserve.bench.loadgen import LoadConfig, send_requests
from pdserve.bench.loadgen_workload import arrival_times, random_requests
from pdserve.net import free_ports

PEER_MODEL = Path.home() / ".cache/pdserve/bench-models/peer-model-peer-4096"
PDSERVE = Path(sys.executable).parent / "pdserve"
PARTS = ("time_to_first_token", "prefill_compute", "queue_wait")


def _mean(metrics: str, part: str) -> float:
    total = re.search(rf"^pdserve_{part}_seconds_sum(?:{{[^}}]*}})? (\S+)", metrics, re.M)
    count = re.search(rf"^pdserve_{part}_seconds_count(?:{{[^}}]*}})? (\S+)", metrics, re.M)
    return float(total.group(1)) / max(float(count.group(1)), 1.0) if total and count else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(PEER_MODEL))
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--transfer", default="tcp", choices=("tcp", "nixl"))
    ap.add_argument("--max-tokens", type=int, default=8, help="output tokens per request")
    ap.add_argument("--prefill-arg", action="append", default=[], help="one more flag for the prefill (repeatable)")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="Poisson arrivals per second (0: one request after another)")
    args = ap.parse_args()
    if not Path(args.model).exists():
        raise SystemExit(f"no checkpoint at {args.model}: `pdserve bench experiment peer` writes it, or pass --model")
    http, grpc, dec, dec_http, kv = free_ports(5)
    common = ["--model", args.model, "--served-model-name", "bench", "--log-level", "WARNING", "--threads", "1",
              "--num-blocks", "256", "--max-model-len", str(args.prompt + 320), "--transfer", args.transfer]
    procs = [subprocess.Popen(["taskset", "-c", "1", str(PDSERVE), "decode", "--host", "127.0.0.1", "--port", str(dec),
                               "--http-port", str(dec_http), "--kv-port", str(kv), *common]),
             subprocess.Popen(["taskset", "-c", "0", str(PDSERVE), "prefill", "--host", "127.0.0.1",
                               "--port", str(http), "--grpc-port", str(grpc), *common, "--decode", f"127.0.0.1:{dec}",
                               *args.prefill_arg])]
    base = f"http://127.0.0.1:{http}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(base + "/ready", timeout=1)  # 503 until a decode reported load
                break
            except OSError:
                time.sleep(1)
        else:
            raise SystemExit("the prefill did not become ready in 300 s")
        rng = random.Random(0)
        specs = random_requests(args.requests, args.prompt, args.max_tokens, rng, list(range(16000)))
        config = LoadConfig(url=base, model="bench", progress=False)
        if args.rate > 0:
            results, _ = asyncio.run(send_requests(config, specs, arrivals=arrival_times(len(specs), args.rate,
                                                                                          "poisson", rng)))
        else:
            results, _ = asyncio.run(send_requests(config, specs, concurrency=1))
        for r in results:
            print(f"request {r.index}: sent at {r.sent_at:.3f} s, " + (f"client TTFT {r.ttft:.3f} s" if r.ok else
                  f"failed (HTTP {r.status}): {r.error[:300]}"), flush=True)
        ttfts = [r.ttft for r in results if r.ok]
        failed = sorted(r.status for r in results if not r.ok)
        print(f"client TTFT mean {statistics.fmean(ttfts) if ttfts else float('nan'):.3f} s over {len(ttfts)} "
              f"requests; {len(failed)} failed {failed}")
        metrics = urllib.request.urlopen(base + "/metrics").read().decode()
        print("prefill's metrics, mean over the requests: "
              + ", ".join(f"{part} {_mean(metrics, part):.3f} s" for part in PARTS))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
