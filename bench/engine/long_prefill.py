"""One long prompt's prefill on one CPU core: its time, and the same in another tree, A B A B.

    .venv/bin/python bench/engine/long_prefill.py --model DIR [--prompt 2048] [--reps 3]
        [--max-num-batched-tokens N] [--profile] [--against OTHER_PYTHON] [--pairs 3] [--cpu 0]

One process loads the checkpoint (float32), builds an LLMEngine and prefills ``--reps`` prompts of ``--prompt``
random token ids (a new prompt each time: no prefix-cache hit) through ``engine.pd.prefill_only`` (a P/D
prefill's path: the first token sampled, the KV kept), one torch thread. Each prefill prints one JSON line:
its wall time, this thread's CPU time and the first token (greedy; the same seeds give the same prompts in
every tree, so the tokens must match across trees). ``--profile`` prints torch.profiler's table of the last
prefill's operators by self CPU time instead.

``--against PY``: the A/B. This script runs ``--pairs`` times in a child process of this tree's python and of
``PY`` (another checkout's venv python: this file imports only ``pdserve.engine``'s public names, so an older
tree runs it too), alternating A B A B, each child pinned to ``--cpu`` with taskset; per pair it prints the
median prefill of each and the ratio A / B. The first prefill of each child is a warm-up, not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def one_process(a: argparse.Namespace) -> None:
    import torch

    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, load_model

    torch.set_num_threads(1)
    loaded = load_model(a.model, dtype=torch.float32, device="cpu", seed=0)
    blocks = -(-a.prompt // 64) * (a.reps + 2)
    cfg = EngineConfig(num_blocks=blocks, max_model_len=a.prompt + 64, enable_prefix_cache=False)
    if a.max_num_batched_tokens:
        cfg.max_num_batched_tokens = a.max_num_batched_tokens
    engine = LLMEngine(loaded, cfg)
    vocab = loaded.config.vocab_size
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    for rep in range(a.reps + 1):  # rep 0: warm-up
        g = torch.Generator().manual_seed(1000 + rep)
        ids = torch.randint(0, vocab - 2, (a.prompt,), generator=g).tolist()
        prof = None
        if a.profile and rep == a.reps:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        w0, c0 = time.perf_counter(), time.thread_time()
        token = engine.pd.prefill_only(f"p{rep}", ids, greedy)
        wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
        engine.pd.release(f"p{rep}")
        if prof is not None:
            prof.__exit__(None, None, None)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), flush=True)
        print(json.dumps({"rep": rep, "wall_s": wall, "cpu_s": cpu, "token": token}), flush=True)


def child(python: str, a: argparse.Namespace) -> list[dict]:
    argv = ["taskset", "-c", str(a.cpu), python, os.path.abspath(__file__), "--model", a.model,
            "--prompt", str(a.prompt), "--reps", str(a.reps)]
    if a.max_num_batched_tokens:
        argv += ["--max-num-batched-tokens", str(a.max_num_batched_tokens)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return [r for r in rows if r["rep"] > 0]


def ab(a: argparse.Namespace) -> None:
    print(f"A {sys.executable}\nB {a.against}\nprompt {a.prompt} tokens, {a.reps} prefills per child (+1 warm-up), "
          f"cpu {a.cpu}, load {os.getloadavg()}", flush=True)
    ratios = []
    for pair in range(a.pairs):
        med = {}
        for name, py in (("A", sys.executable), ("B", a.against)):
            rows = child(py, a)
            med[name] = {k: statistics.median(r[k] for r in rows) for k in ("wall_s", "cpu_s")}
            print(f"pair {pair + 1} {name}: wall {med[name]['wall_s']:.3f} s, cpu {med[name]['cpu_s']:.3f} s, "
                  f"tokens {[r['token'] for r in rows]}, load {os.getloadavg()[0]:.2f}", flush=True)
        ratios.append(med["A"]["wall_s"] / med["B"]["wall_s"])
        print(f"pair {pair + 1}: A / B wall {ratios[-1]:.3f}, cpu {med['A']['cpu_s'] / med['B']['cpu_s']:.3f}",
              flush=True)
    print(f"A / B wall per pair: {', '.join(f'{r:.3f}' for r in ratios)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory (the peer experiment's: peer_model.py)")
    p.add_argument("--prompt", type=int, default=2048, help="prompt tokens (default 2048)")
    p.add_argument("--reps", type=int, default=3, help="prefills per process after a warm-up (default 3)")
    p.add_argument("--max-num-batched-tokens", type=int, default=0, help="the step budget (default: the engine's)")
    p.add_argument("--profile", action="store_true", help="torch.profiler's table of the last prefill")
    p.add_argument("--against", default=None, help="another tree's python: the A/B (A: this python)")
    p.add_argument("--pairs", type=int, default=3, help="A B pairs with --against (default 3)")
    p.add_argument("--cpu", type=int, default=0, help="the core the A/B children are pinned to (default 0)")
    a = p.parse_args()
    if a.against:
        ab(a)
    else:
        one_process(a)


if __name__ == "__main__":
    main()
