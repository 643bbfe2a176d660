"""Section 7, tp: tensor parallelism (engine/tp/) on this machine's devices, TP n against TP 1 on one checkpoint.

The checkpoint: the plan's shape with ``tp_layers`` decoder layers (the 8B shape's widths on a GPU: the
all-reduces and shards are what is measured, not depth), random weights written once to a temporary
directory, because every rank loads its own shard from the files (``load_model(..., tensor_parallel_size)``).
Sizes: TP 1 and every power of two up to the GPUs this process sees (NCCL, one GPU per rank); in a CPU smoke
run TP 1 and TP 2 (gloo, one worker process). Per size, in one ``LLMEngine``:

- **tokens**: greedy output of ``tp_prompts`` random prompts (``tp_tokens`` tokens each), compared with TP 1's.
  In bf16 a different all-reduce order may flip a near-tie: a size whose tokens differ is repeated in float32
  (the verdict is float32's; the bf16 difference is reported beside it).
- **prefill**: one prompt of ``prefill_len`` tokens in one step, median of ``tp_reps``; ratio TP 1 / TP n.
- **decode**: steps of batch 1 and batch ``tp_decode_batch`` after a 128-token prompt: mean step time; ratio
  TP 1 / TP n (above 1: TP n is faster).

On one GPU only TP 1 runs (its figures are the baseline a multi-GPU run compares with) and the section says
that TP > 1 is unmeasured here, and why. Nothing from here is a target's verdict: issue 47 reports multi-GPU
speed as unmeasured until a machine with several GPUs runs this section.
"""

from __future__ import annotations

import statistics
import tempfile
import time

from checklib import Budget, Record, guarded, log, release, sig, sync

DECODE_PROMPT = 128


def sizes_here(device) -> tuple[list[int], str]:
    """The TP sizes this machine can run and, when that is only TP 1, why."""
    import torch

    if device.type != "cuda":
        return [1, 2], ""
    n = torch.cuda.device_count()
    sizes = [s for s in (1, 2, 4, 8) if s <= n]
    why = "" if n > 1 else f"TP > 1 unmeasured: this process sees {n} GPU (NCCL needs one GPU per rank)"
    return sizes, why


def write_checkpoint(plan, directory: str, dtype) -> object:
    """The plan's shape with ``tp_layers`` layers, random weights stored in ``dtype`` (the run's: half the bytes of
    float32 on a GPU; the float32 repeat loads the same file)."""
    from pdserve.engine import ModelConfig
    from pdserve.engine.checkpoint import random_hf_weights, save_hf_checkpoint

    cfg = ModelConfig(**{**plan.model_shape, "num_layers": plan.tp_layers})
    save_hf_checkpoint({k: v.to(dtype) for k, v in random_hf_weights(cfg, seed=7).items()}, cfg, directory)
    return cfg


def run_tp(ctx, rec: Record, budget: Budget) -> None:
    import torch

    plan = ctx.plan
    sizes, why = sizes_here(ctx.device)
    rec.results.update(sizes=sizes, dtype=ctx.dtype_name, layers=plan.tp_layers, runs=[])
    if why:
        rec.results["unmeasured"] = why
        rec.note(why)
    with tempfile.TemporaryDirectory(prefix="tp-ckpt-") as path:
        log("tp", f"writing a random {plan.tp_layers}-layer checkpoint of the plan's shape to {path}")
        write_checkpoint(plan, path, ctx.dtype)
        gen = torch.Generator().manual_seed(11)
        vocab = plan.model_shape["vocab_size"]
        prompts = [torch.randint(3, vocab, (plan.tp_tokens,), generator=gen).tolist() for _ in range(plan.tp_prompts)]
        base: dict = {}
        for size in sizes:
            if budget.left() <= 0:
                rec.skip(f"TP {size}", "budget spent")
                continue
            row: dict = {"size": size}
            rec.results["runs"].append(row)
            with guarded(rec, f"TP {size}", row, ctx.device):
                measure_size(ctx, path, size, prompts, row, base)
            rec.save()
            release(ctx.device)


def measure_size(ctx, path: str, size: int, prompts: list, row: dict, base: dict) -> None:
    """One size's tokens, prefill and decode (the TP 1 row is ``base`` for the others' ratios)."""
    row.update(run_engine(ctx, path, size, ctx.dtype, prompts))
    if size == 1:
        base.update(row)
        return
    row["tokens_equal"] = row["tokens"] == base["tokens"]
    if not row["tokens_equal"] and ctx.dtype_name != "float32":
        import torch

        row["tokens_equal_dtype"] = False
        f32 = {s: run_engine(ctx, path, s, torch.float32, prompts, timed=False)["tokens"] for s in (1, size)}
        row["tokens_equal"] = f32[1] == f32[size]
    row["prefill_speedup"] = sig(base["prefill_ms"] / row["prefill_ms"])
    for key in ("decode_b1_ms", "decode_bn_ms"):
        row[key.replace("_ms", "_speedup")] = sig(base[key] / row[key])
    log("tp", f"TP {size}: tokens {'equal' if row['tokens_equal'] else 'DIFFER'}; prefill x{row['prefill_speedup']}, "
              f"decode b1 x{row['decode_b1_speedup']}, b{ctx.plan.tp_decode_batch} x{row['decode_bn_speedup']} "
              f"against TP 1")


def run_engine(ctx, path: str, size: int, dtype, prompts: list, timed: bool = True) -> dict:
    from pdserve.engine import EngineConfig, LLMEngine, load_model

    plan = ctx.plan
    max_len = max(plan.prefill_len, DECODE_PROMPT + plan.decode_steps) + 8
    loaded = load_model(path, dtype=dtype, device=ctx.device, tensor_parallel_size=size)
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=max(plan.tp_decode_batch, len(prompts)), max_model_len=max_len,
                                            enable_prefix_cache=False, max_num_batched_tokens=max_len,
                                            long_prefill_threshold=0, tensor_parallel_size=size))
    try:
        out: dict = {"tokens": greedy(engine, prompts, plan.tp_tokens)}
        if timed:
            out["prefill_ms"] = sig(time_prefill(ctx, engine, plan.prefill_len, plan.tp_reps))
            out["decode_b1_ms"] = sig(time_decode(ctx, engine, 1, plan.decode_steps))
            out["decode_bn_ms"] = sig(time_decode(ctx, engine, plan.tp_decode_batch, plan.decode_steps))
        return out
    finally:
        engine.close()
        del engine, loaded


def greedy(engine, prompts: list, tokens: int) -> list[list[int]]:
    from pdserve.engine import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"g{i}", prompt, params)
    done: dict = {f"g{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] += out.new_token_ids
    return [done[f"g{i}"] for i in range(len(prompts))]


def time_prefill(ctx, engine, length: int, reps: int) -> float:
    from pdserve.engine import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times = []
    for rep in range(reps + 1):  # the first is a warm-up
        sync(ctx.device)
        t0 = time.perf_counter()
        engine.add_request(f"p{rep}", [5 + (i * 7 + rep) % 900 for i in range(length)], params)
        while engine.has_unfinished():
            engine.step()
        sync(ctx.device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:])


def time_decode(ctx, engine, batch: int, steps: int) -> float:
    """Mean ms per step of ``batch`` rows decoding after a DECODE_PROMPT-token prompt each (prefills excluded)."""
    from pdserve.engine import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for r in range(batch):
        engine.add_request(f"d{batch}-{r}", [3 + (i * 11 + r) % 800 for i in range(DECODE_PROMPT)], params)
    sched = engine.scheduler
    while sched.waiting or any(not s.output_ids for s in sched.running):
        engine.step()  # the prompts (and their first tokens)
    sync(ctx.device)
    t0, n = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        n += 1
    sync(ctx.device)
    return (time.perf_counter() - t0) * 1e3 / max(n, 1)
