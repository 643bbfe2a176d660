"""Section 7, fp8: the plan's random Llama (8B shape on a GPU) with FP8 weights against the same weights in
the check's dtype (issue 45's GPU targets).

The FP8 model is built by the loader from the same seeded random tensors as perf.py's model, its
projections quantized at load (``--quantization fp8``: one scale per output row); embeddings, norms and
the LM head stay in the dtype. On a GPU with FP8 tensor cores its matmuls are ``torch._scaled_mm`` with
per-token activation scales (``engine/fp8.py``; the section records which path ran).

- **decode** at the plan's ``fp8_decode_batches`` x ``fp8_context``: one decode cell per model (perf.py's
  cell: random KV, DecodeGraphs captured where CUDA is), timed A B A B for ``fp8_rounds`` rounds; the ratio
  FP8 / dtype step time per round. Target: <= 0.6 at batch 1 (half the weight bytes).
- **prefill** of ``fp8_prefill_prompts`` x ``prefill_len`` through ``prefill_many``, A B A B; the speedup
  dtype / FP8. Target: >= 1.5 at 8 x 2k.
- **accuracy**: the first token of ``fp8_accuracy_prompts`` random prompts from both models (the same
  prefill calls) and the FP8 model's logits against the dtype model's on one prompt (max |diff| / std).
- **kv**: tokens an FP8 KV pool holds in the bytes of a dtype pool (``KVCache.block_nbytes``, the
  model's head size and the plan's block size). Target: >= 1.9x.
"""

from __future__ import annotations

import statistics

from cells import model_config, time_steps
from checklib import Budget, Record, guarded, log, release, sig, sync
from perf import PrefillRunner, build_random_model, get_model, open_cell, prefill_engine

DECODE_TARGET, PREFILL_TARGET, KV_TARGET = 0.6, 1.5, 1.9


def get_fp8_model(ctx):
    if "fp8_model" not in ctx.state:
        from pdserve.engine.quant_config import QuantScheme

        log("fp8", f"building the FP8 twin of the random model on {ctx.device}")
        ctx.state["fp8_model"] = build_random_model(model_config(ctx.plan), ctx.dtype, ctx.device,
                                                    scheme=QuantScheme("online-fp8"))
        sync(ctx.device)
    return ctx.state["fp8_model"]


def run_fp8(ctx, rec: Record, budget: Budget) -> None:
    from pdserve.engine import fp8

    plan = ctx.plan
    models = {"dtype": get_model(ctx), "fp8": get_fp8_model(ctx)}
    rec.results.update(path=fp8.describe(ctx.device), dtype=ctx.dtype_name, decode=[], prefill=[])
    rec.results["kv"] = kv = {}
    with guarded(rec, "kv", kv, ctx.device):
        kv.update(kv_ratio(ctx, models["dtype"].cfg))
    for batch in plan.fp8_decode_batches:
        label = f"decode B{batch} ctx {plan.fp8_context}"
        if budget.left() <= 0:
            rec.skip(label, "budget spent")
            continue
        row = {"batch": batch, "context": plan.fp8_context}
        rec.results["decode"].append(row)
        with guarded(rec, label, row, ctx.device):
            decode_ab(ctx, models, row, label)
        rec.save()
        release(ctx.device)
    if budget.left() > 0:
        prefill_and_accuracy(ctx, rec, models, budget)
    else:
        rec.skip("prefill", "budget spent")
    ctx.state.pop("fp8_model", None)  # the P/D section's servers want the memory
    del models
    release(ctx.device)


def kv_ratio(ctx, cfg) -> dict:
    """Tokens per byte of an FP8 KV pool over the dtype's (one block of one layer each)."""
    import inspect

    from pdserve.engine import KVCache

    if "kv_dtype" not in inspect.signature(KVCache).parameters:
        return {"note": "this tree's KVCache has no kv_dtype (no FP8 KV cache)"}
    args = (1, 1, ctx.plan.block_size, cfg.num_kv_heads, cfg.head_dim, ctx.dtype, "cpu")
    plain, fp8 = KVCache(*args).block_nbytes, KVCache(*args, kv_dtype="fp8").block_nbytes
    return {"dtype_block_bytes": plain, "fp8_block_bytes": fp8, "tokens_ratio": sig(plain / fp8)}


def decode_ab(ctx, models: dict, row: dict, label: str) -> None:
    cells = {}
    for side, model in models.items():
        cell = open_cell(ctx, model, row["batch"], row["context"])
        if isinstance(cell, str):
            row["note"] = f"{side}: {cell}"
            return
        if ctx.device.type == "cuda":
            row[f"{side}_capture_s"] = round(cell.graphs.capture(), 2)
        cells[side] = cell
    rounds = []
    for r in range(ctx.plan.fp8_rounds):
        order = ("dtype", "fp8") if r % 2 == 0 else ("fp8", "dtype")
        ms = {side: time_steps(ctx, cells[side])[0] for side in order}
        rounds.append({"dtype_ms": sig(ms["dtype"]), "fp8_ms": sig(ms["fp8"]), "ratio": sig(ms["fp8"] / ms["dtype"])})
    ratios = [x["ratio"] for x in rounds]
    row.update(rounds=rounds, ratio=sig(statistics.median(ratios)), worst_ratio=max(ratios),
               graphs=ctx.device.type == "cuda")
    log("fp8", f"{label}: FP8 / {ctx.dtype_name} step " + ", ".join(f"{x['ratio']:.3f}" for x in rounds))
    for cell in cells.values():
        cell.graphs.close()


def prefill_and_accuracy(ctx, rec: Record, models: dict, budget: Budget) -> None:
    import torch

    plan = ctx.plan
    length, most = plan.prefill_len, max(plan.fp8_prefill_prompts + (plan.fp8_accuracy_prompts,))
    engines = {side: prefill_engine(ctx, m, most, length) for side, m in models.items()}
    runners = {side: PrefillRunner(ctx, e, length) for side, e in engines.items()}
    for prompts in plan.fp8_prefill_prompts:
        label = f"prefill {prompts} x {length}"
        if budget.left() <= 0:
            rec.skip(label, "budget spent")
            continue
        row = {"prompts": prompts, "length": length}
        rec.results["prefill"].append(row)
        with guarded(rec, label, row, ctx.device):
            for runner in runners.values():
                runner.time_once(prompts)  # warm-up
            rounds = []
            for r in range(plan.prefill_reps):
                order = ("dtype", "fp8") if r % 2 == 0 else ("fp8", "dtype")
                s = {side: runners[side].time_once(prompts) for side in order}
                rounds.append({"dtype_s": sig(s["dtype"]), "fp8_s": sig(s["fp8"]),
                               "speedup": sig(s["dtype"] / s["fp8"])})
            speedups = [x["speedup"] for x in rounds]
            row.update(rounds=rounds, speedup=sig(statistics.median(speedups)), worst_speedup=min(speedups))
            log("fp8", f"{label}: {ctx.dtype_name} / FP8 time " + ", ".join(f"{x:.3f}" for x in speedups))
        rec.save()
    rec.results["accuracy"] = acc = {}
    with guarded(rec, "accuracy", acc, ctx.device), torch.inference_mode():
        acc.update(first_tokens(engines, models["dtype"].cfg.vocab_size, plan.fp8_accuracy_prompts, min(length, 256)))
    for engine in engines.values():
        engine.close()
    release(ctx.device)


def first_tokens(engines: dict, vocab: int, prompts: int, length: int) -> dict:
    """First tokens of the same random prompts from both models (one prefill_many each) and their logits:
    the fraction of equal first tokens, and max |logit diff| / std of the dtype model's logits."""
    import random

    from pdserve.engine import SamplingParams

    rng = random.Random(9)
    ids = [[rng.randrange(vocab) for _ in range(length)] for _ in range(prompts)]
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    firsts, logits = {}, {}
    for side, engine in engines.items():
        seen, sample = [], engine.sampler.sample

        def keep(batch_logits, params, positions, seen=seen, sample=sample):
            seen.append(batch_logits.float().clone())
            return sample(batch_logits, params, positions)

        engine.sampler.sample = keep
        reqs = [(f"acc-{side}-{i}", p, sp) for i, p in enumerate(ids)]
        try:
            got = engine.pd.prefill_many(reqs)
        finally:
            engine.sampler.sample = sample
        firsts[side] = [got[rid] for rid, _, _ in reqs]
        logits[side] = seen[0]
        for rid, _, _ in reqs:
            engine.pd.release(rid)
    diff = (logits["fp8"] - logits["dtype"]).abs().max().item()
    return {"prompts": prompts, "length": length,
            "first_token_agreement": sig(sum(a == b for a, b in zip(firsts["dtype"], firsts["fp8"])) / prompts),
            "max_logit_diff_over_std": sig(diff / logits["dtype"].std().item())}
