"""Tensor parallelism on the CPU: TP 2 (one torch thread per rank) against TP 1 on one thread, with TP 1 on two
threads beside them (the same two cores without the all-reduces), in one process, A B A B.

    .venv/bin/python -m pdserve.bench.engine.tensor_parallel [--rounds 3] [--prompt-len 2048] [--decode-steps 32]

The model is the peer experiment's ~121M-parameter random Llama (``experiments/peer_model.py`` "peer": hidden
1024, 8 layers, 16 heads / 2 KV heads, MLP 2816, vocabulary 16384; float32), loaded once per case: TP 1 one
thread, TP 2 (rank 0 here, rank 1 a worker process, one thread each: a decode step's all-reduces and logits
gather through shared memory, ``engine/tp/shm_collectives.py``, larger ones by gloo), TP 1 two threads, and TP 2
with every collective by gloo (``tensor_parallel_shm=False``: what shared memory saves).

- prefill: one request of ``--prompt-len`` random tokens, max_tokens 1, computed in one step (no chunking, no
  prefix cache): the time from add_request to its token;
- decode: one request (a 128-token prompt) then ``--decode-steps`` steps of batch 1: the mean time per step.

Each round times every case in turn, the order reversed every other round; wall clock (the ranks are
processes). A ratio is the median over rounds of the TP 1 one-thread time over the case's time (above 1:
faster), with its min-max. The CPU is named from lscpu, and the load average is printed before and after:
the box may be shared, and TP 2 needs both cores at once.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from pdserve.bench.experiments.peer_model import peer_config
from pdserve.bench.provenance import machine
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, load_model
from pdserve.engine.checkpoint import random_hf_weights, save_hf_checkpoint

CASES = (("TP 1, 1 thread", 1, 1, True), ("TP 2, 1 thread per rank", 2, 1, True), ("TP 1, 2 threads", 1, 2, True),
         ("TP 2, gloo collectives", 2, 1, False))
DECODE_PROMPT = 128


def make_engine(path: str, ranks: int, threads: int, max_len: int, shm: bool = True) -> LLMEngine:
    torch.set_num_threads(threads)  # (a worker rank takes rank 0's count when it starts)
    loaded = load_model(path, tensor_parallel_size=ranks)
    return LLMEngine(loaded, EngineConfig(max_num_seqs=1, max_model_len=max_len, enable_prefix_cache=False,
                                          max_num_batched_tokens=max_len, long_prefill_threshold=0,
                                          tensor_parallel_size=ranks, tensor_parallel_shm=shm))


def time_prefill(engine: LLMEngine, prompt: list[int]) -> float:
    start = time.perf_counter()
    engine.add_request("prefill", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def time_decode(engine: LLMEngine, prompt: list[int], steps: int) -> float:
    engine.add_request("decode", prompt, SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))
    engine.step()  # the prompt (and the first token)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = (time.perf_counter() - start) / steps
    while engine.has_unfinished():
        engine.step()
    return elapsed


def measure(engines: list, threads: list[int], what, rounds: int) -> list[list[float]]:
    """times[case][round], the cases' order reversed every other round."""
    times: list[list[float]] = [[] for _ in engines]
    for r in range(rounds):
        order = range(len(engines)) if r % 2 == 0 else reversed(range(len(engines)))
        for i in order:
            torch.set_num_threads(threads[i])
            times[i].append(what(engines[i]))
    return times


def report(title: str, times: list[list[float]], unit: float, unit_name: str) -> None:
    print(title)
    base = times[0]
    for (name, *_), t in zip(CASES, times):
        ratios = [b / x for b, x in zip(base, t)]
        print(f"  {name:26s} {statistics.median(t) * unit:9.1f} {unit_name}   TP 1 (1 thread) / this: "
              f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--decode-steps", type=int, default=32)
    a = p.parse_args()
    max_len = max(a.prompt_len, DECODE_PROMPT + a.decode_steps) + 64
    cfg = peer_config("peer", max_len)
    m = machine()
    print(f"{m['cpu_model']} ({m['cpus']} CPUs), torch {torch.__version__}, load average {m['load_avg']}")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size - 2, (a.prompt_len,), generator=gen).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_checkpoint(random_hf_weights(cfg, seed=0, std=0.05), cfg, tmp)
        n_params = sum(t.numel() for t in load_model(tmp).model.state_dict().values())
        print(f"random Llama {n_params / 1e6:.0f}M parameters (hidden {cfg.hidden_size}, {cfg.num_layers} layers, "
              f"{cfg.num_heads}/{cfg.num_kv_heads} heads, MLP {cfg.intermediate_size}, vocabulary {cfg.vocab_size}), "
              f"float32; {a.rounds} rounds, order reversed every other round; wall clock")
        engines = [make_engine(tmp, ranks, threads, max_len, shm) for _, ranks, threads, shm in CASES]
        threads = [t for _, _, t, _ in CASES]
        try:
            for i, e in enumerate(engines):  # warm-up: the first call of each kernel
                torch.set_num_threads(threads[i])
                time_prefill(e, prompt[:256])
                time_decode(e, prompt[:DECODE_PROMPT], 2)
            prefill = measure(engines, threads, lambda e: time_prefill(e, prompt), a.rounds)
            decode = measure(engines, threads, lambda e: time_decode(e, prompt[:DECODE_PROMPT], a.decode_steps),
                             a.rounds)
        finally:
            for e in engines:
                e.close()
    report(f"prefill of a {a.prompt_len}-token prompt (one step):", prefill, 1e3, "ms")
    report(f"decode step at batch 1 (mean of {a.decode_steps} steps after a {DECODE_PROMPT}-token prompt):", decode,
           1e3, "ms")
    print(f"load average after: {list(os.getloadavg())}")


if __name__ == "__main__":
    main()
