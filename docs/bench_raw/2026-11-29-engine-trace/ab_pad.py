"""A B A B: the trace's 185 prefills through pdserve's engine alone (bench/tools/trace_engine_compute.py's
run_pdserve), prefix_attend padding short prefixes (PAD_SHORT_PREFIX=8, A) against always merging two calls (B)."""
import json, sys
sys.path.insert(0, "tests")
from harness.bench_tools import load_bench_tool
from pdserve.engine import attention
tool = load_bench_tool("trace_engine_compute")
import argparse, statistics
from pdserve.bench.experiments import peer_trace
from pdserve.bench.experiments.peer_model import peer_model
from pdserve.bench.experiments.launcher import MODEL_CACHE
from pdserve.bench.loadgen_workload import tokenizer_prompt_ids
targs = argparse.Namespace(**peer_trace.TRACE_DEFAULTS, trace=tool.DEFAULT_TRACE, seed=0)
max_len = peer_trace.max_len(targs)
model = str(peer_model(MODEL_CACHE, "small", max(4096, max_len)))
pool = tokenizer_prompt_ids(model)
prompts = [list(s.prompt_ids) for s in peer_trace.workload(targs, pool).specs]
warm = [pool[(7 * i) % len(pool)] for i in range(round(statistics.median(len(x) for x in prompts)))]
out = []
for rnd in range(2):
    for arm, pad in (("A pad", 8), ("B merge", 10**9)) if rnd % 2 == 0 else (("B merge", 10**9), ("A pad", 8)):
        attention.PAD_SHORT_PREFIX = pad
        rows = tool.run_pdserve(model, prompts, warm, max_len)
        s = tool.summary(rows)
        out.append({"arm": arm, "round": rnd, "summary": s})
        print(arm, rnd, f"CPU {s['cpu_s']:.1f} s, hits {s['hit_share']:.1%}", flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
