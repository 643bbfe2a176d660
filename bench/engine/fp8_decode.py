"""FP8 weights against bf16 on this machine's CPU: decode step time and weight bytes per step, A B A B.

    .venv/bin/python -m pdserve.bench.engine.fp8_decode [--batches 1,4,8] [--rounds 6] [--threads 1]

A Llama-shaped checkpoint of about 240M parameters with seeded random weights (hidden 1024, 16 layers,
GQA 16/4 heads, MLP 2816, vocabulary 32000; written once to ``~/.cache/pdserve/bench-models``) is
loaded twice in bfloat16: plain, and with ``--quantization fp8`` (projections FP8, one scale per row;
embeddings and LM head bf16). Per batch size, each engine prefills the same prompts (``--context``
tokens), then they take turns: ``--steps`` decode steps of A, the same of B, for ``--rounds`` rounds
(A B A B ...). It prints each round's median step time per side, the ratio FP8 / bf16 per round and
over all rounds, and the bytes of weights a decode step reads (projections, and everything). A verdict
("FP8 no slower") holds only when every round's ratio is <= 1. ``--json`` writes the record with the
machine (CPU model, commit) for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from pdserve.bench.provenance import run_start, write_json
from pdserve.engine import EngineConfig, LLMEngine, ModelConfig, SamplingParams, fp8, load_model, native
from pdserve.engine.checkpoint import random_hf_weights, save_hf_checkpoint

SHAPE = ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=16, num_heads=16,
                    num_kv_heads=4, max_position_embeddings=4096)
MODEL_DIR = Path.home() / ".cache/pdserve/bench-models/fp8-bench-llama-240m"


def checkpoint() -> Path:
    if not (MODEL_DIR / "config.json").exists():
        print(f"writing the bench checkpoint to {MODEL_DIR} (once) ...", flush=True)
        save_hf_checkpoint(random_hf_weights(SHAPE, seed=0, std=0.02), SHAPE, MODEL_DIR)
    return MODEL_DIR


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of the layers' projections, bytes of every weight a decode step reads: + norms, LM head, one
    embedding row per token, counted as the LM head's matrix since they are tied or the same size)."""
    proj = total = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if name.startswith("embed_tokens"):
            continue
        total += nbytes
        if name.endswith("proj.weight") or "experts" in name:
            proj += nbytes
    return proj, total


def decode_engines(directory: Path, batch: int, context: int):
    engines = {}
    for side, quantization in (("bf16", None), ("fp8", "fp8")):
        loaded = load_model(str(directory), dtype=torch.bfloat16, quantization=quantization)
        engine = LLMEngine(loaded, EngineConfig(num_blocks=batch * ((context + 2000) // 64 + 2), max_num_seqs=batch))
        gen = torch.Generator().manual_seed(batch)
        sp = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"{side}-{i}", torch.randint(0, SHAPE.vocab_size, (context,), generator=gen).tolist(),
                               sp)
        while engine.scheduler.waiting or any(not s.output_ids for s in engine.scheduler.running):
            engine.step()  # every prompt prefilled: from here each step() is one decode step of the batch
        engines[side] = engine
    return engines


def time_steps(engine: LLMEngine, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        out.append(time.perf_counter() - start)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,4,8", help="decode batch sizes, comma-separated")
    p.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=8, help="decode steps per side per round")
    p.add_argument("--rounds", type=int, default=6, help="A B rounds (alternating which side goes first)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--json", default=None, help="write the record here")
    args = p.parse_args(argv)
    started = run_start()
    torch.set_num_threads(args.threads)
    rec = {"threads": args.threads, "context": args.context, "fp8_path": fp8.describe(
        torch.device("cpu")), "batches": {}}
    flags = set(native.cpu_flags().split())
    rec["isa"] = [f for f in ("avx2", "f16c", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    print(f"CPU: {started['cpu_model']} ({' '.join(rec['isa'])}); commit {started['git_commit']}; "
          f"{args.threads} thread(s); FP8 matmuls: {rec['fp8_path']}")
    directory = checkpoint()
    for batch in (int(b) for b in args.batches.split(",")):
        engines = decode_engines(directory, batch, args.context)
        byts = {side: weight_bytes(e.model) for side, e in engines.items()}
        rounds = []
        for r in range(args.rounds):
            order = ("bf16", "fp8") if r % 2 == 0 else ("fp8", "bf16")
            med = {side: statistics.median(time_steps(engines[side], args.steps)) for side in order}
            rounds.append({"bf16_ms": med["bf16"] * 1e3, "fp8_ms": med["fp8"] * 1e3, "ratio": med["fp8"] / med["bf16"]})
        ratios = [x["ratio"] for x in rounds]
        rec["batches"][batch] = {"rounds": rounds, "median_ratio": statistics.median(ratios),
                                 "projection_bytes": {s: b[0] for s, b in byts.items()},
                                 "step_weight_bytes": {s: b[1] for s, b in byts.items()}}
        print(f"batch {batch}: " + "  ".join(f"{x['bf16_ms']:.1f}/{x['fp8_ms']:.1f} ms ({x['ratio']:.2f})"
                                             for x in rounds))
        verdict = "FP8 no slower in every round" if max(ratios) <= 1 else "FP8 slower in some round"
        print(f"  FP8 / bf16 step time: median {statistics.median(ratios):.2f}, rounds {min(ratios):.2f}-"
              f"{max(ratios):.2f} -> {verdict}")
        print(f"  weight bytes per step: projections {byts['fp8'][0] / byts['bf16'][0]:.2f}x "
              f"({byts['fp8'][0] / 2**20:.0f} / {byts['bf16'][0] / 2**20:.0f} MiB), with norms and LM head "
              f"{byts['fp8'][1] / byts['bf16'][1]:.2f}x")
        del engines
    if args.json:
        write_json(args.json, rec)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
