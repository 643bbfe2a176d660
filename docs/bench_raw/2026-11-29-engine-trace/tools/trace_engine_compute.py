"""The peer trace's prefills through each engine alone: no server, no P/D, one request at a time, by CPU time.

    .venv/bin/python bench/tools/trace_engine_compute.py [--requests N] [--repeats 2] [--json out.json]

``bench/tools/peer_trace_alone.py --load`` found pdserve's prefill engine computing 88.7 s for the trace's
185 requests where vLLM P/D's prefill times summed to 59 s. That compares two serving stacks (HTTP, the
KV transfer, the threads beside the engine). This tool takes the stacks away: each engine, in-process and
on one thread, prefills the same prompts in the trace's order with its prefix cache on, one request and one
output token at a time, and each request is timed by the CPU time of the process (robust on a shared box).
pdserve's ``LLMEngine`` runs in this process; vLLM-CPU's ``LLM`` in a child process of its own python
(in-process engine core, OpenMP on one core, eager mode), as ``bench/engine/vllm_baseline.py`` runs it.
Both load the peer experiment's ``small`` checkpoint in float32 with 16,384 tokens of KV. The engines
alternate A B A B over ``--repeats``; each repeat starts a fresh engine (an empty prefix cache).

Printed per engine and repeat: the CPU seconds summed over the requests, and the same for the requests
with and without a prefix hit (pdserve's hits from its scheduler; vLLM's from each output's
``num_cached_tokens``). The ratio pdserve / vLLM pairs repeat i of each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdserve.bench.experiments import peer_trace
from pdserve.bench.experiments.peer_vllm import vllm_python
from pdserve.bench.experiments.trace_routing import DEFAULT_TRACE
from pdserve.bench.provenance import machine

KV_TOKENS = 16384

# vLLM's side: the prompts one at a time through LLM.generate, each timed by the process's CPU time.
CHILD = r"""
import json, sys, time
from vllm import LLM, SamplingParams, __version__
model, spec = sys.argv[1], json.load(open(sys.argv[2]))
llm = LLM(model=model, dtype="float32", max_model_len=spec["max_len"], enforce_eager=True,
          kv_cache_memory_bytes=spec["kv_bytes"], enable_prefix_caching=True, seed=0, skip_tokenizer_init=True)
sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False)
llm.generate([{"prompt_token_ids": spec["warm"]}], sp, use_tqdm=False)
rows = []
for ids in spec["prompts"]:
    t = time.process_time()
    out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
    rows.append({"cpu": time.process_time() - t, "prompt": len(ids), "hits": out.num_cached_tokens or 0})
print("RESULT " + json.dumps({"rows": rows, "version": __version__}), flush=True)
"""


def run_pdserve(model: str, prompts: list[list[int]], warm: list[int], max_len: int) -> list[dict]:
    import torch

    from pdserve.defaults import BLOCK_SIZE
    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, load_model

    torch.set_num_threads(1)
    engine = LLMEngine(load_model(model, dtype=torch.float32),
                       EngineConfig(num_blocks=-(-KV_TOKENS // BLOCK_SIZE), block_size=BLOCK_SIZE,
                                    max_model_len=max_len, enable_prefix_cache=True, detokenize=False))
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def one(tag: str, ids: list[int]) -> dict:
        before = engine.prefix_hit_tokens()
        t = time.process_time()
        engine.add_request(tag, ids, sp)
        while engine.has_unfinished():
            engine.step()
        cpu = time.process_time() - t
        return {"cpu": cpu, "prompt": len(ids), "hits": engine.prefix_hit_tokens() - before}

    one("warm", warm)
    return [one(str(i), ids) for i, ids in enumerate(prompts)]


def run_vllm(python: str, model: str, prompts: list[list[int]], warm: list[int], max_len: int) -> tuple[list, str]:
    from pdserve.bench.experiments.peer_model import kv_bytes_per_token

    spec = {"prompts": prompts, "warm": warm, "max_len": max_len,
            "kv_bytes": KV_TOKENS * kv_bytes_per_token("small", 4)}
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as cwd:  # not the repository: its operator/ shadows the stdlib
        Path(cwd, "spec.json").write_text(json.dumps(spec))  # too long for an argument
        proc = subprocess.run([python, "-c", CHILD, model, "spec.json"], capture_output=True, text=True,
                              env=env, cwd=cwd, timeout=3600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"vLLM ({python}) failed with {proc.returncode}:\n{proc.stderr[-3000:]}")
    out = json.loads(lines[-1][len("RESULT "):])
    return out["rows"], out["version"]


def summary(rows: list[dict]) -> dict:
    hit = [r["cpu"] for r in rows if r["hits"] > 0]
    miss = [r["cpu"] for r in rows if r["hits"] == 0]
    prompt = sum(r["prompt"] for r in rows)
    return {"cpu_s": sum(r["cpu"] for r in rows), "hit_share": sum(r["hits"] for r in rows) / prompt,
            "with_hit_n": len(hit), "with_hit_cpu_s": sum(hit), "no_hit_n": len(miss), "no_hit_cpu_s": sum(miss)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--requests", type=int, default=None, help="only the first N of the trace's requests")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--engines", default="pdserve,vllm", help="comma-separated, in the order of each repeat")
    p.add_argument("--json", type=Path, default=None, help="write every request's row and the summaries here")
    a = p.parse_args()
    t = peer_trace.default_trace(a.trace)
    trace_args, max_len, model, pool, work = t.args, t.max_len, t.model, t.pool, t.work
    prompts = [list(s.prompt_ids) for s in work.specs[: a.requests]]
    warm = [pool[(7 * i) % len(pool)] for i in range(round(statistics.median(len(x) for x in prompts)))]
    m = machine()
    print(f"{peer_trace.describe(trace_args, work)}; {len(prompts)} prompts one at a time, 1 output token; "
          f"{m['cpu_model']}, 1 thread, process CPU time", flush=True)
    doc = {"machine": m, "command": " ".join(sys.argv), "runs": []}
    for repeat in range(a.repeats):
        for name in a.engines.split(","):
            if name == "pdserve":
                rows, version = run_pdserve(model, prompts, warm, max_len), "this checkout"
            else:
                rows, version = run_vllm(vllm_python(), model, prompts, warm, max_len)
            s = summary(rows)
            doc["runs"].append({"engine": name, "version": version, "repeat": repeat, "summary": s, "rows": rows})
            print(f"{name} ({version}) #{repeat + 1}: CPU {s['cpu_s']:.1f} s for {len(rows)} prefills; prefix hits "
                  f"{s['hit_share']:.1%}; with a hit {s['with_hit_n']} took {s['with_hit_cpu_s']:.1f} s, without "
                  f"{s['no_hit_n']} took {s['no_hit_cpu_s']:.1f} s", flush=True)
    by = {name: [r["summary"]["cpu_s"] for r in doc["runs"] if r["engine"] == name] for name in ("pdserve", "vllm")}
    if by["pdserve"] and by["vllm"]:
        ratios = [x / y for x, y in zip(by["pdserve"], by["vllm"])]
        doc["ratios"] = ratios
        print("pdserve / vLLM CPU seconds, per repeat: " + ", ".join(f"{r:.2f}" for r in ratios))
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
