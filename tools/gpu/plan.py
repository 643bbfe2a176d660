"""What one GPU check run does: its sections, the shapes and repetitions of each (``FULL`` on a
GPU, ``SMOKE`` for tiny shapes on a CPU), the budgets, and the command line that picks them.
``check.py`` (the supervisor and its worker) reads everything from here; the section modules
get the ``Plan`` through their context."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, replace

SECTIONS = ("ceilings", "parity", "decode", "prefill", "transformers", "fp8", "pd", "tp")
# seconds each later section is guaranteed before the deadline (a slow section cannot starve them)
RESERVE = {"ceilings": 5, "parity": 20, "decode": 30, "prefill": 15, "transformers": 30, "fp8": 30, "pd": 75, "tp": 20}
FINAL = ("ok", "partial", "error", "killed", "crashed", "skipped")
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                 num_kv_heads=8, head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                 architecture="LlamaForCausalLM", bos_token_id=128000, eos_token_ids=[128001])
TINY = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=500000.0,
            architecture="LlamaForCausalLM", bos_token_id=1, eos_token_ids=[2])


@dataclass
class Plan:
    """Every shape, repetition count and budget of a run (``FULL`` on a GPU, ``SMOKE`` for tiny)."""

    copy_bytes: int = 2 << 30
    gemm_n: int = 8192
    ceiling_reps: int = 10
    ceiling_warmup: int = 3
    parity_tokens: int = 16
    model_shape: dict = field(default_factory=lambda: dict(LLAMA3_8B))
    block_size: int = 64  # the engine's BLOCK_SIZE
    decode_batches: tuple = (1, 8, 32, 128, 256)
    decode_contexts: tuple = (1024, 4096)
    decode_steps: int = 20
    decode_warmup: int = 3
    decode_ab_cells: tuple = ((1, 1024), (32, 1024))  # fused RMSNorm/rotary off vs on; the smallest is profiled
    prefill_prompts: tuple = (1, 8, 32)
    prefill_len: int = 2048
    prefill_reps: int = 3
    hf_decode_batches: tuple = (1, 8, 32)
    hf_context: int = 1024
    hf_prefill_prompts: tuple = (1, 8, 32)
    hf_reps: int = 5  # warm samples per side (after one warm-up each), medians compared
    hf_steps: int = 10
    pd_requests: int = 4
    pd_long_prompts: tuple = (1024, 2048, 8192)  # pdpair.py's long cell: TTFT against the prefill alone, KV moved
    pd_long_layers: int = 4  # ... on a checkpoint of the plan's widths with this many layers
    fp8_decode_batches: tuple = (1, 32)  # fp8cells.py: FP8 weights against the dtype's, A B A B
    fp8_context: int = 1024
    fp8_rounds: int = 4
    fp8_prefill_prompts: tuple = (8,)
    fp8_accuracy_prompts: int = 8
    tp_layers: int = 4  # tpcell.py: the plan's widths with this many layers, TP 1 against every TP size that fits
    tp_prompts: int = 4
    tp_tokens: int = 16
    tp_reps: int = 3
    tp_decode_batch: int = 8
    budgets: dict = field(default_factory=lambda: {"ceilings": 30, "parity": 75, "decode": 150, "prefill": 45,
                                                   "transformers": 110, "fp8": 60, "pd": 240,
                                                   "tp": 90})
    deadline: float = 450.0  # seconds after the start; the device command's limit is 600
    smoke: bool = False


FULL = Plan()
SMOKE = Plan(copy_bytes=16 << 20, gemm_n=256, ceiling_reps=3, ceiling_warmup=1, model_shape=dict(TINY),
             block_size=16, decode_batches=(1, 2), decode_contexts=(64, 128), decode_steps=3, decode_warmup=1,
             decode_ab_cells=((1, 64),),
             prefill_prompts=(1, 2), prefill_len=64, prefill_reps=2, hf_decode_batches=(1, 2), hf_context=64,
             hf_prefill_prompts=(1, 2), hf_reps=2, hf_steps=3, pd_requests=1, pd_long_prompts=(64, 128),
             fp8_decode_batches=(1,),
             fp8_context=64, fp8_rounds=2, fp8_prefill_prompts=(2,), fp8_accuracy_prompts=2,
             tp_layers=2, tp_prompts=2, tp_tokens=6, tp_reps=1, tp_decode_batch=2,
             budgets={"ceilings": 20, "parity": 60, "decode": 30, "prefill": 30, "transformers": 45, "fp8": 30,
                      "pd": 90, "tp": 60},
             deadline=280.0, smoke=True)


# ---- arguments ---------------------------------------------------------------------------------
def parse_args(argv: list[str], doc: str) -> argparse.Namespace:
    """The check's command line; ``doc`` (check.py's docstring) is its --help."""
    p = argparse.ArgumentParser(prog="tools/gpu/check.py", description=doc.split("\n\n")[0],
                                epilog=doc.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out",
                   help="folder for check.json, sections/ (default: $OUT, else ./gpu-check-out)")
    p.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (default: cuda where torch sees one)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes and 1-3 repetitions (the whole path in well under a minute on a CPU)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="dtype of sections 1 and 3-6 (auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--parity-dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="dtype of the parity section (auto: bfloat16 on CUDA, float32 on CPU, where bf16 "
                        "greedy tokens of transformers itself flip against its float32 ones)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds after the start when everything stops (default 450; smoke 280)")
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every section's budget")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds a section may run past its budget before its worker is killed (default 30)")
    p.add_argument("--pd", default="auto", choices=["auto", "on", "off"],
                   help="the P/D pair section (auto: on, except in a --smoke run without --device cuda[:N], "
                        "where its two servers would take most of the run)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-sections", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bad = [s for s in args.sections.split(",") if s not in SECTIONS]
    if bad:
        p.error(f"unknown section(s) {bad}; choose from {','.join(SECTIONS)}")
    return args


def make_plan(args: argparse.Namespace) -> Plan:
    plan = SMOKE if args.smoke else FULL
    plan = replace(plan, budgets={k: v * args.budget_scale for k, v in plan.budgets.items()})
    return replace(plan, deadline=args.deadline) if args.deadline is not None else plan


def wanted_sections(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """(sections to run, {section: why skipped})."""
    chosen = [s for s in SECTIONS if s in args.sections.split(",")]
    skipped = {s: "not in --sections" for s in SECTIONS if s not in chosen}
    smoke_off_gpu = args.smoke and not args.device.startswith("cuda")  # the supervisor imports no torch
    if "pd" in chosen and (args.pd == "off" or args.pd == "auto" and smoke_off_gpu):
        chosen.remove("pd")
        skipped["pd"] = ("--pd off" if args.pd == "off"
                         else "skipped in a smoke run without --device cuda (--pd on runs it)")
    return chosen, skipped
