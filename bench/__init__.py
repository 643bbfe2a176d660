"""Benchmarks. Each prints its figures side by side with a baseline measured in the same run.

This package holds the tools (load generator, experiments); no server imports it.

  pdserve bench engine       prefill/decode tokens/s vs transformers on the same weights
  pdserve bench cachestore   layer-wise KV transfer vs raw socket and raw NIXL throughput
  pdserve bench serving      load generator against any OpenAI endpoint (TTFT, TPOT, ITL, goodput)
  pdserve bench experiment   the P/D experiments of docs/benchmarks.md
  pdserve bench chaos        kill and pause servers under load: no hang, no wrong text, no leak
  pdserve bench conformance  pass/fail checks of any OpenAI endpoint: greedy answers, SSE, usage, cancellation,
                             4xx on bad input, streams when a server is killed (--kill-cmd)
  pdserve bench slo-policy   the cost of one ordering decision of the SLO queue (fifo, edf, qlm)

Run 'pdserve bench NAME --help' for the options of one benchmark.
"""

from __future__ import annotations

from pdserve.cli import Dispatcher

# name -> module exposing add_arguments(parser) and run(args)
BENCHES: dict[str, str] = {
    "engine": "pdserve.engine.bench",
    "cachestore": "pdserve.cachestore.bench",
    "serving": "pdserve.bench.loadgen",
    "experiment": "pdserve.bench.experiments",
    "chaos": "pdserve.bench.chaos",
    "conformance": "pdserve.bench.conformance",
    "slo-policy": "pdserve.bench.slo_policy",
}


add_arguments, run = Dispatcher("pdserve bench", BENCHES, "benchmark").functions()
