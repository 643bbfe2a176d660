"""Benchmarks, all of them in this one package. Each prints its figures side by side with a
baseline measured in the same run. No part imports this package; it imports the parts it
measures (tests/unit/test_import_arrows.py).

  pdserve bench engine       prefill/decode tokens/s vs transformers on the same weights (engine/)
  pdserve bench cachestore   layer-wise KV transfer vs raw socket and raw NIXL throughput (cachestore/)
  pdserve bench serving      load generator against any OpenAI endpoint (TTFT, TPOT, ITL, goodput)
  pdserve bench experiment   the P/D experiments of docs/benchmarks.md (experiments/)
  pdserve bench chaos        kill and pause servers under load: no hang, no wrong text, no leak (chaos/)
  pdserve bench conformance  pass/fail checks of any OpenAI endpoint: greedy answers, SSE, usage, cancellation,
                             4xx on bad input, streams when a server is killed (--kill-cmd) (conformance/)
  pdserve bench slo-policy   the cost of one ordering decision of the SLO queue (fifo, edf, qlm)
  pdserve bench reproduce    rerun a row of docs/results.md and print its new figure beside the published one
  pdserve bench sim-profile  fit a profile of the simulated engine (--engine sim) to the built-in engine's steps here
  pdserve bench router-scale the router and its KV index at 16-64 prefills: req/s on one core, added latency, restart

Run 'pdserve bench NAME --help' for the options of one benchmark.

Developer A/B scripts (tools/, not a package and not installed: run them from a checkout as
``.venv/bin/python bench/tools/NAME.py --help``):

  decode_step.py        decode step time of the engine at batch, A B per change; --profile: where a step goes
  step_ab.py            decode step time of two checkouts of the engine (before / after a change), A B A B
  native_attention.py   the C++ decode attention (engine/csrc) vs its torch path; --against REV
  operator_converge.py  N InferenceServices on a real control plane: time to converge, operator memory
  conformance_vllm.py   pdserve bench conformance against vLLM's own P/D (a pair it starts)

One-off investigation tools live beside the raw output of the figure they produced
(docs/bench_raw/<run>/tools/, docs/bench_raw/README.md), not here.

Reading path: loadgen.py (and its _workload and _report modules) is the client every serving
benchmark uses; then the folder of the benchmark at hand, whose __init__ describes its files.
"""

from __future__ import annotations

from pdserve.cli import Dispatcher

from .provenance import run_start

# name -> module exposing add_arguments(parser) and run(args)
BENCHES: dict[str, str] = {
    "engine": "pdserve.bench.engine.tokens_per_s",
    "cachestore": "pdserve.bench.cachestore.transfer",
    "serving": "pdserve.bench.loadgen",
    "experiment": "pdserve.bench.experiments",
    "chaos": "pdserve.bench.chaos",
    "conformance": "pdserve.bench.conformance",
    "slo-policy": "pdserve.bench.slo_policy",
    "reproduce": "pdserve.bench.reproduce",
    "sim-profile": "pdserve.bench.sim_profile",
    "router-scale": "pdserve.bench.router_scale",
}


add_arguments, _run_bench = Dispatcher("pdserve bench", BENCHES, "benchmark").functions()


def run(args):
    """Record where and on what the run starts (provenance.run_start: load, CPU, commit, dirty tree), then run
    the benchmark; every result it writes carries that record."""
    run_start()
    return _run_bench(args)
