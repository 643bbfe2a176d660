"""Sections 3-4 on one random Llama (Llama-3-8B's shape on a GPU): decode steps and prefill (section 5,
the same model against transformers, is hf_compare.py).

The model: ``ModelConfig`` of the plan's shape (8B: hidden 4096, intermediate 14336, 32 layers,
32 heads / 8 KV heads of 128, vocab 128256) built by ``engine.loader.build_model`` from random
tensors made on the device (std 0.02, norms 1 + 0.1 noise; no checkpoint, no download). One model
per worker process, shared by the three sections.

**decode** (section 3), per cell batch B x context C: a ``KVCache`` of B x ceil((C + 1) / block)
blocks filled once with random values; row r owns blocks [r*n, (r+1)*n) and decodes the token
at position C (it attends over C + 1 positions and writes its K/V at slot C: the same slot every
step, so the context never grows). Steps run through ``DecodeGraphs`` (engine/decode_graphs.py)
restricted to the one bucket B: **eager** (its body, not captured) and **graphs** (``capture()``,
then replays; CUDA only). Step time = median of ``decode_steps`` steps after ``decode_warmup``,
each timed alone (checklib.time_ms: the step's host work, input copies and kernels).
Bytes a step must read = the weights it multiplies (every parameter but the embedding table, of
which it reads B rows) + the context's KV: B * C * layers * 2 * kv_heads * head_dim * dtype bytes.
Achieved = bytes / step time; its fraction of section 1's copy bandwidth is the roofline figure.
A cell whose KV needs more than 85% of the free memory is reported "does not fit (N GiB KV)".

**prefill** (section 4): N prompts of L random tokens through ``LLMEngine.pd.prefill_many`` (one
forward; prefix cache off, no CUDA graphs), released after each timing; time = wall clock
between device synchronizes, median of ``prefill_reps`` after one warm-up. FLOP =
2 * (decoder layers' parameters) * N * L  +  2 * hidden * vocab * N (the LM head on each last
row)  +  4 * layers * heads * head_dim * N * L^2 / 2 (causal attention: QK^T and PV);
TFLOP/s and its fraction of section 1's GEMM rate.

**transformers** (section 5, hf_compare.py): ``LlamaForCausalLM`` of the same config whose parameters ARE this
model's tensors (no copy; checked by comparing logits on one prompt). Per cell, ours and
theirs alternate repetition by repetition (A B, B A, ...), so drift hits both alike:
decode at batch B with context C (theirs: their own forward over the C tokens builds a
DynamicCache, rebuilt before each repetition; then single-token steps; ours: the decode cell
above, CUDA graphs where captured), and prefill of N x L (theirs: one forward with
``use_cache=True, logits_to_keep=1``, what ``generate`` does first; ours: prefill_many).
Speedup = their median time / ours (> 1: ours is faster).
"""

from __future__ import annotations

import math
import statistics
import time

from cells import DecodeCell, fmt_step, model_config, roofline, time_steps
from checklib import Budget, Record, free_bytes, gib, guarded, log, read_json, release, sig, sync
from probes import attention_ab, fused_exactness, probe_cell

FIT_FRACTION = 0.85


# ---- the model ---------------------------------------------------------------------------------
def build_random_model(cfg, dtype, device, seed: int = 0, std: float = 0.02, scheme=None):
    """A DecoderModel with random weights drawn on ``device`` (through the loader's own build_model);
    ``scheme``: a QuantScheme (fp8cells.py: the same tensors, projections quantized to FP8 at load)."""
    import torch

    from pdserve.engine.checkpoint import hf_tensor_shapes
    from pdserve.engine.loader import build_model

    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = hf_tensor_shapes(cfg)

    def tensor(name: str):
        t = torch.randn(shapes[name], generator=gen, device=device, dtype=dtype)
        return t.mul_(0.1).add_(1.0) if name.endswith("norm.weight") else t.mul_(std)

    if scheme is None:
        return build_model(cfg, tensor, dtype, device)
    return build_model(cfg, tensor, dtype, device, scheme)


def get_model(ctx):
    """The worker's one random model of the plan's shape (built on first use)."""
    if "model" not in ctx.state:
        cfg = model_config(ctx.plan)
        log("model", f"building a random {cfg.num_layers}-layer model (hidden {cfg.hidden_size}, vocab "
                     f"{cfg.vocab_size}) in {ctx.dtype_name} on {ctx.device}")
        t0 = time.time()
        model = build_random_model(cfg, ctx.dtype, ctx.device)
        sync(ctx.device)
        n = sum(p.numel() for p in model.parameters())
        log("model", f"built: {n / 1e6:.1f} M parameters, {gib(n * model_dtype_bytes(model))} GiB, "
                     f"{time.time() - t0:.1f} s")
        ctx.state["model"] = model
    return ctx.state["model"]


def model_dtype_bytes(model) -> int:
    return next(model.parameters()).element_size()


def step_weight_bytes(model) -> int:
    """Bytes of the weights a decode step multiplies: every parameter but an untied embedding table."""
    params = {id(p): p for p in model.parameters()}
    if not model.cfg.tie_word_embeddings:
        params.pop(id(model.embed_tokens.weight), None)
    return sum(p.numel() * p.element_size() for p in params.values())


def layer_params(model) -> int:
    return sum(p.numel() for p in model.layers.parameters())


def ceiling(ctx, key: str, field: str) -> float | None:
    """A figure of section 1 (from this worker's memory, else from its file)."""
    data = ctx.state.get("ceilings") or read_json(ctx.out / "sections" / "ceilings.json") or {}
    value = (data.get("results") or {}).get(key, {}).get(field)
    return value if isinstance(value, (int, float)) and value > 0 else None


# ---- decode ------------------------------------------------------------------------------------
def attention_mode(kv) -> str:
    """The attention backend the engine would run on this cache (attention_backends.choose)."""
    from pdserve.engine import attention_backends

    return attention_backends.choose(kv, kv.device)


def make_graphs(model, kv, batch: int, max_blocks: int, attention: str):
    """DecodeGraphs for exactly one bucket, ``batch`` (no capture of the smaller buckets)."""
    import inspect

    from pdserve.engine.decode_graphs import DecodeGraphs

    kwargs = {"attention": attention} if "attention" in inspect.signature(DecodeGraphs).parameters else {}
    graphs = DecodeGraphs(model, kv, batch, max_blocks, **kwargs)
    graphs.buckets = (batch,)  # the buffers are sized for `batch`; only its graph is captured
    return graphs


def random_kv(cfg, num_blocks: int, block_size: int, dtype, device, seed: int = 1):
    import torch

    from pdserve.engine import KVCache

    kv = KVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for layer in range(cfg.num_layers):  # one layer at a time: under 2^31 elements per kernel
        kv.layer(layer).normal_(generator=gen)
    return kv


def decode_rows(kv, batch: int, context: int, blocks_per_row: int, vocab: int, seed: int = 2):
    """One DecodeRow per sequence: blocks of its own, the new token at position ``context``."""
    import random

    from pdserve.engine.decode_graphs import DecodeRow

    rng, bs = random.Random(seed), kv.block_size
    rows = []
    for r in range(batch):
        table = list(range(r * blocks_per_row, (r + 1) * blocks_per_row))
        slot = int(kv.slot_indices(table[context // bs], context % bs))
        rows.append(DecodeRow(rng.randrange(vocab), context, slot, table))
    return rows


def kv_context_bytes(cfg, batch: int, context: int, elem: int) -> int:
    return batch * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elem


def cell_need(cfg, batch: int, context: int, block_size: int, elem: int) -> tuple[int, int]:
    """(blocks per row, bytes of the KV pool the cell allocates)."""
    per_row = math.ceil((context + 1) / block_size)
    block_bytes = 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem * cfg.num_layers
    return per_row, batch * per_row * block_bytes


def open_cell(ctx, model, batch: int, context: int) -> DecodeCell | str:
    """The cell, or the string saying why it does not fit."""
    cfg, bs = model.cfg, ctx.plan.block_size
    per_row, need = cell_need(cfg, batch, context, bs, model_dtype_bytes(model))
    free = free_bytes(ctx.device)
    if need > FIT_FRACTION * free:
        return f"does not fit ({gib(need)} GiB KV, {gib(free)} GiB free)"
    kv = random_kv(cfg, batch * per_row, bs, ctx.dtype, ctx.device)
    attention = attention_mode(kv)
    rows = decode_rows(kv, batch, context, per_row, cfg.vocab_size)
    return DecodeCell(kv, rows, make_graphs(model, kv, batch, per_row, attention), attention, need)


def capture(ctx, cell: DecodeCell, rec: Record, label: str) -> float | None:
    """Capture the cell's graph (CUDA); its seconds, or None with a note when it cannot be had."""
    if ctx.device.type != "cuda":
        return None
    try:
        return cell.graphs.capture()
    except Exception as exc:
        rec.note(f"{label}: graph capture failed ({type(exc).__name__}: {exc}); graphs variant not measured")
        return None


def run_decode(ctx, rec: Record, budget: Budget) -> None:
    plan = ctx.plan
    if ctx.device.type == "cuda":
        rec.results["fused_exactness"] = exact = {}
        with guarded(rec, "fused exactness", exact, ctx.device):
            exact.update(fused_exactness(ctx))
    model = get_model(ctx)
    wbytes = step_weight_bytes(model)
    copy_gbps = ceiling(ctx, "copy", "gb_per_s")
    rec.results.update(weight_bytes=wbytes, copy_gb_per_s=copy_gbps, block_size=plan.block_size, cells=[])
    if copy_gbps is None:
        rec.note("no copy bandwidth from section 1: fractions not computed")
    for context in plan.decode_contexts:
        for batch in plan.decode_batches:
            label = f"batch {batch} x context {context}"
            if budget.left() <= 0:
                rec.skip(label, "budget spent")
                continue
            kv_bytes = kv_context_bytes(model.cfg, batch, context, model_dtype_bytes(model))
            row = {"batch": batch, "context": context, "kv_bytes": kv_bytes, "bytes_read": wbytes + kv_bytes}
            rec.results["cells"].append(row)
            rec.save()  # a cell killed mid-way still shows in the file
            log("decode", f"{label}: KV {gib(kv_bytes)} GiB + weights {gib(wbytes)} GiB per step")
            with guarded(rec, label, row, ctx.device):
                decode_cell(ctx, rec, model, row, label, copy_gbps)
            rec.save()
            release(ctx.device)


def decode_cell(ctx, rec: Record, model, row: dict, label: str, copy_gbps: float | None) -> None:
    """Fill ``row`` with the eager and the captured step of one cell (or why it does not fit)."""
    cell = open_cell(ctx, model, row["batch"], row["context"])
    if isinstance(cell, str):
        row["fits"], row["note"] = False, cell
        rec.note(f"{label}: {cell}")
        return
    row.update(fits=True, attention=cell.attention, kv_alloc_bytes=cell.kv_alloc_bytes)
    ms, samples = time_steps(ctx, cell)
    row["eager"] = {**roofline(ms, row["bytes_read"], copy_gbps), "samples_ms": samples}
    rec.save()
    log("decode", f"{label} eager: {fmt_step(row['eager'])}")
    seconds = capture(ctx, cell, rec, label)
    if seconds is None:
        row["graphs"] = {"status": "n/a on cpu" if ctx.device.type != "cuda" else "capture failed"}
    else:
        ms, samples = time_steps(ctx, cell)
        row["graphs"] = {**roofline(ms, row["bytes_read"], copy_gbps), "capture_s": round(seconds, 2),
                         "samples_ms": samples}
        log("decode", f"{label} graphs: {fmt_step(row['graphs'])} (capture {seconds:.1f} s)")
    if (row["batch"], row["context"]) in ctx.plan.decode_ab_cells and (seconds is not None or ctx.plan.smoke):
        probe_cell(ctx, rec, model, cell, row, label, copy_gbps, graphs=seconds is not None)
    cell.graphs.close()


# ---- prefill -----------------------------------------------------------------------------------
def prefill_engine(ctx, model, max_prompts: int, length: int):
    """An LLMEngine over ``model`` sized for ``max_prompts`` prompts of ``length`` (prefix cache off, eager)."""
    import torch

    from pdserve.engine import EngineConfig, LLMEngine
    from pdserve.engine.loader import LoadedModel
    from pdserve.engine.tokenizer import ByteTokenizer

    cfg, bs = model.cfg, ctx.plan.block_size
    loaded = LoadedModel("random", cfg, model, ByteTokenizer(), ctx.dtype, torch.device(ctx.device))
    blocks = max_prompts * math.ceil((length + 1) / bs) + 4
    return LLMEngine(loaded, EngineConfig(num_blocks=blocks, block_size=bs, max_num_seqs=max(max_prompts, 1),
                                          enable_prefix_cache=False, max_num_batched_tokens=max_prompts * length,
                                          long_prefill_threshold=0,  # every prompt whole in one forward
                                          cuda_graphs=False, detokenize=False))


def prefill_flop(model, prompts: int, length: int) -> float:
    cfg = model.cfg
    dense = 2 * layer_params(model) * prompts * length + 2 * cfg.hidden_size * cfg.vocab_size * prompts
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * prompts * length**2 / 2
    return float(dense + attention)


class PrefillRunner:
    """Times ``engine.pd.prefill_many`` of N random prompts of L tokens, releasing them after each call."""

    def __init__(self, ctx, engine, length: int):
        import random

        self.ctx, self.engine, self.length = ctx, engine, length
        self.rng = random.Random(5)
        self.calls = 0

    def time_once(self, prompts: int) -> float:
        from pdserve.engine import SamplingParams

        vocab = self.engine.model_config.vocab_size
        sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        self.calls += 1
        reqs = [(f"p{self.calls}-{i}", [self.rng.randrange(vocab) for _ in range(self.length)], sp)
                for i in range(prompts)]
        sync(self.ctx.device)
        t0 = time.perf_counter()
        self.engine.pd.prefill_many(reqs)
        sync(self.ctx.device)
        seconds = time.perf_counter() - t0
        for rid, _, _ in reqs:
            self.engine.pd.release(rid)
        return seconds


def run_prefill(ctx, rec: Record, budget: Budget) -> None:
    plan = ctx.plan
    rec.results["attention_ab"] = ab = {}
    with guarded(rec, "attention A/B", ab, ctx.device):
        ab.update(attention_ab(ctx, plan.prefill_prompts[min(1, len(plan.prefill_prompts) - 1)], plan.prefill_len))
    release(ctx.device)
    model = get_model(ctx)
    gemm = ceiling(ctx, "gemm", "tflop_per_s")
    length = plan.prefill_len
    engine = prefill_engine(ctx, model, max(plan.prefill_prompts), length)
    rec.results.update(length=length, gemm_tflop_per_s=gemm, attention=getattr(engine.runner, "attention", "torch"),
                       cells=[])
    runner = PrefillRunner(ctx, engine, length)
    for prompts in plan.prefill_prompts:
        label = f"{prompts} x {length}"
        if budget.left() <= 0:
            rec.skip(label, "budget spent")
            continue
        log("prefill", f"{label}: 1 warm-up + {plan.prefill_reps} timed prefill_many calls")
        row = {"prompts": prompts, "length": length, "flop": prefill_flop(model, prompts, length)}
        rec.results["cells"].append(row)
        rec.save()  # a cell killed mid-way still shows in the file
        with guarded(rec, label, row, ctx.device):
            runner.time_once(prompts)
            samples = [runner.time_once(prompts) for _ in range(plan.prefill_reps)]
            seconds = statistics.median(samples)
            tflops = row["flop"] / seconds / 1e12
            row.update(s=sig(seconds), tflop_per_s=sig(tflops), samples_s=[sig(x) for x in samples],
                       fraction_of_gemm=None if not gemm else sig(tflops / gemm))
            frac = "" if not gemm else f" = {100 * tflops / gemm:.0f}% of GEMM"
            log("prefill", f"{label}: {seconds * 1e3:.1f} ms, {tflops:.4g} TFLOP/s{frac}")
        rec.save()
    engine.close()
    del engine, runner
    release(ctx.device)
