"""Probes of the GPU check beside its figures (perf.py calls them): what a change did and where a
step's time goes, measured in the same run.

* ``fused_exactness``: the Triton RMSNorm, rotary and silu*mul against the torch ops they replace,
  bitwise, on random inputs of the 8B shape (CUDA).
* ``probe_cell`` (decode cells of ``plan.decode_ab_cells``): ``ab_switch`` for each engine switch
  (fused elementwise kernels, merged projections, the decode attention's program target), off on
  off on, each captured afresh; ``profile_step`` (torch.profiler: kernels per step, kernel time,
  the top kernels) of one eager step and one graph replay; ``split_sweep``, one layer's decode
  attention by partition count.
* ``attention_ab`` (prefill): one layer's prefill attention, torch's SDPA against
  ``gpu_attention.paged_prefill`` at each of PREFILL_LAUNCHES.
"""

from __future__ import annotations

import math
import statistics

from checklib import Record, log, sig, sync, time_median, time_ms
from cells import DecodeCell, fmt_step, model_config, roofline, time_steps


def fused_exactness(ctx) -> dict:
    """The Triton RMSNorm and rotary against the torch ops they replace, on random bf16/fp32 inputs of
    the 8B shape: the fraction of bitwise-equal elements and the largest difference (CUDA only)."""
    import torch

    import torch.nn.functional as F

    from pdserve.engine import gpu_elementwise, layer_ops
    from pdserve.engine.models.llama import RMSNorm

    ops = {False: layer_ops.TorchOps(), True: layer_ops.TritonOps()}  # EngineConfig.fused_elementwise off / on

    gen = torch.Generator(device=ctx.device).manual_seed(11)
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).split(".")[-1]
        for rows, n in ((1, 4096), (4096, 4096), (64, 128)):
            x = (torch.randn(rows, n, generator=gen, device=ctx.device) * 2).to(dtype)
            norm = RMSNorm(n, 1e-5).to(ctx.device, dtype)
            norm.weight.data = (1 + 0.1 * torch.randn(n, generator=gen, device=ctx.device)).to(dtype)
            got = {}
            for fused in (False, True):  # the module's ops (layer_ops.choose by EngineConfig.fused_elementwise)
                norm.ops = ops[fused]
                got[fused] = norm(x)
            out[f"rms_norm {name} {rows}x{n}"] = compare(got[False], got[True])
        for t, h in ((1, 32), (2048, 8)):
            x = torch.randn(t, h, 128, generator=gen, device=ctx.device).to(dtype)
            ang = torch.randn(t, 1, 128, generator=gen, device=ctx.device) * 50
            cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
            out[f"rope {name} {t}x{h}x128"] = compare(ops[False].rope(x, cos, sin), ops[True].rope(x, cos, sin))
        gate_up = torch.randn(64, 2 * 14336, generator=gen, device=ctx.device).to(dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        out[f"silu_mul {name} 64x14336"] = compare(F.silu(gate).mul_(up), gpu_elementwise.silu_mul(gate_up))
    for k, v in out.items():
        log("decode", f"fused {k}: {100 * v['equal']:.2f}% bitwise equal to the torch ops, "
                      f"max |diff| {v['max_diff']:.3g}")
    return out


def compare(a, b) -> dict:
    return {"equal": sig((a == b).float().mean().item()), "max_diff": sig((a.float() - b.float()).abs().max().item())}


def probe_cell(ctx, rec: Record, model, cell: DecodeCell, row: dict, label: str, copy_gbps: float | None,
               graphs: bool) -> None:
    """A decode cell of ``decode_ab_cells``: an A/B of each engine switch, a kernel profile, and (with
    the Triton attention, or in a smoke run) the decode attention alone by partition count."""
    from pdserve.engine import gpu_attention

    switches = (("fused_ab", model_switch(model, "fused_elementwise"),
                 "RMSNorm + rotary as torch ops / Triton kernels"),
                ("merged_ab", model_switch(model, "merged_projections"),
                 "q,k,v and gate,up as separate / merged matmuls"),
                ("splits_ab", attr_switch(gpu_attention, "_TARGET_PROGRAMS", 256, 1024),
                 "decode attention aiming at 256 / 1024 programs"))
    for key, apply, what in switches:
        rec.save()
        ab_switch(ctx, cell, row, label, copy_gbps, graphs, key, apply, what)
    rec.save()
    row["profile"] = profile_step(ctx, cell, label)
    if cell.attention == "triton" or ctx.plan.smoke:
        rec.save()
        row["decode_splits"] = split_sweep(ctx, model, cell, label)


def model_switch(model, name: str):
    """An ab_switch ``apply`` for an engine switch (EngineConfig's ``name``, set on the model as the engine
    does: ``DecoderModel.configure``): off, on, then on again (every switch's default)."""

    def apply(variant: str) -> None:
        model.configure(**{name: variant != "off"})
    return apply


def attr_switch(obj, name: str, off, on):
    """An ab_switch ``apply`` that sets ``obj.name`` to ``off`` / ``on``, then back."""
    saved = getattr(obj, name)

    def apply(variant: str) -> None:
        setattr(obj, name, {"off": off, "on": on, "restore": saved}[variant])
    return apply


def ab_switch(ctx, cell: DecodeCell, row: dict, label: str, copy_gbps: float | None, graphs: bool, key: str,
              apply, what: str) -> None:
    """The captured step with a switch off and on (``apply("off" | "on" | "restore")``), alternating
    off on off on, each captured afresh: ``row[key]`` (eager steps where there are no graphs: the
    smoke run's path, where the engine's switches change nothing on a CPU)."""
    times: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for variant in ("off", "on", "off", "on"):
            apply(variant)
            if graphs:
                cell.graphs.close()
                cell.graphs.capture()
            times[variant].append(time_steps(ctx, cell)[0])
    finally:
        apply("restore")
        if graphs:
            cell.graphs.close()
            cell.graphs.capture()
    res = {v: {**roofline(statistics.median(t), row["bytes_read"], copy_gbps), "repetitions_ms": [sig(x) for x in t]}
           for v, t in times.items()}
    res.update(speedup=sig(res["off"]["ms"] / res["on"]["ms"]), what=what)
    row[key] = res
    log("decode", f"{label} {'graphs' if graphs else 'eager'}, {what}: {fmt_step(res['off'])} / "
                  f"{fmt_step(res['on'])}: {res['speedup']:.3g}x (off on off on)")


def split_sweep(ctx, model, cell: DecodeCell, label: str) -> dict:
    """One layer's decode attention alone (``gpu_attention.paged_decode`` on the cell's cache and rows)
    at each partition count: ms per call (median of decode_steps calls after two), the count the engine
    picks marked. Picks the target for ``gpu_attention._TARGET_PROGRAMS``."""
    import torch

    from pdserve.engine import gpu_attention

    graphs, cfg = cell.graphs, model.cfg
    n = len(cell.rows)
    graphs._load(cell.rows, graphs.bucket_for(n))
    tables, ends = graphs.tables[:n], graphs.ends[:n]
    starts = torch.zeros_like(ends)
    gen = torch.Generator(device=ctx.device).manual_seed(6)
    q = torch.randn(n, cfg.num_heads, cfg.head_dim, generator=gen, device=ctx.device).to(ctx.dtype)
    layer = cell.kv.layer(0)
    width = tables.shape[1]
    picked = min(-(-gpu_attention._TARGET_PROGRAMS // (n * cfg.num_kv_heads)), width)
    out = {"picked": picked, "ms": {}}
    with torch.inference_mode():
        for splits in sorted({1, 2, 4, 8, 16, 32, picked} & set(range(1, width + 1))):
            def call(splits=splits):
                return gpu_attention.paged_decode(q, layer, tables, starts, ends, None, num_splits=splits)
            call()
            out["ms"][splits] = sig(time_median(call, ctx.device, ctx.plan.decode_steps, 2)[0])
    best = min(out["ms"], key=out["ms"].get)
    out["best"] = best
    times = ", ".join(f"{k}: {v:.4g} ms" for k, v in out["ms"].items())
    log("decode", f"{label} attention alone (one layer) by partitions: {times}; engine picks {picked}, best {best}")
    return out


def profile_step(ctx, cell: DecodeCell, label: str, steps: int = 3, top: int = 14) -> dict:
    """Kernel time of one step by kernel (torch.profiler), eager and (CUDA) graph replay: where a
    step's time goes (matmuls, attention, the small kernels between them). On a CPU (smoke) the
    "kernels" are the aten ops' self CPU time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = ctx.device.type == "cuda"
    graphs = cell.graphs
    bucket = graphs.bucket_for(len(cell.rows))
    out: dict = {}
    for mode in ("eager", "graphs") if cuda else ("eager",):
        if mode == "graphs":
            run = cell.step
        else:
            graphs._load(cell.rows, bucket)

            def run():
                return graphs._body(bucket)
        with torch.inference_mode():
            run()
            sync(ctx.device)
            with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    run()
                sync(ctx.device)
        kernels: dict[str, list[float]] = {}
        for e in prof.events():
            if cuda and e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
                kernels.setdefault(e.name, []).append(e.device_time)  # microseconds
            elif not cuda and e.name.startswith("aten::") and e.self_cpu_time_total > 0:
                kernels.setdefault(e.name, []).append(e.self_cpu_time_total)
        total = sum(sum(v) for v in kernels.values()) / steps
        count = sum(len(v) for v in kernels.values()) / steps
        rows = sorted(((sum(v) / steps, len(v) / steps, k) for k, v in kernels.items()), reverse=True)[:top]
        out[mode] = {"kernel_us_per_step": sig(total), "kernels_per_step": sig(count),
                     "top": [{"us": sig(us), "count": sig(n), "name": name[:120]} for us, n, name in rows]}
        log("decode", f"{label} {mode} profile: {count:.0f} kernels, {total / 1e3:.3f} ms of kernel time per step")
        for us, n, name in rows:
            log("decode", f"    {us:9.1f} us  {n:6.0f}x  {name[:100]}")
    return out


PREFILL_LAUNCHES = ((64, 4, None), (64, 4, 3), (64, 8, 3), (128, 8, None), (128, 8, 3))  # (BLOCK_M, warps, stages)


def attention_ab(ctx, prompts: int, length: int, reps: int = 5) -> dict:
    """Prefill attention alone, one layer of the plan's shape: ``gpu_attention.paged_prefill`` at each
    launch configuration of PREFILL_LAUNCHES against torch's SDPA (causal, GQA) on the same K/V
    (what transformers runs), alternating; ms, TFLOP/s and max |diff| from SDPA."""
    import torch
    import torch.nn.functional as F

    from pdserve.engine import KVCache, gpu_attention

    cfg, bs = model_config(ctx.plan), ctx.plan.block_size
    h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per = math.ceil(length / bs)
    gen = torch.Generator(device=ctx.device).manual_seed(4)
    q = torch.randn(prompts * length, h, d, generator=gen, device=ctx.device).to(ctx.dtype)
    k = torch.randn(prompts, length, kvh, d, generator=gen, device=ctx.device).to(ctx.dtype)
    v = torch.randn(prompts, length, kvh, d, generator=gen, device=ctx.device).to(ctx.dtype)
    kv = KVCache(1, prompts * per, bs, kvh, d, ctx.dtype, ctx.device)
    layer = kv.layer(0)
    for s in range(prompts):
        for b in range(per):
            n = min(bs, length - b * bs)
            layer[s * per + b, 0, :n] = k[s, b * bs: b * bs + n]
            layer[s * per + b, 1, :n] = v[s, b * bs: b * bs + n]
    tables = torch.arange(prompts * per, device=ctx.device).view(prompts, per)
    starts, lens = [s * length for s in range(prompts)], [length] * prompts
    flop = 4 * h * d * prompts * length**2 / 2
    qb = q.view(prompts, length, h, d).transpose(1, 2)

    def sdpa():
        return F.scaled_dot_product_attention(qb, k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                              enable_gqa=True).transpose(1, 2).reshape(-1, h, d)

    variants = {"sdpa": sdpa}
    launches = PREFILL_LAUNCHES if ctx.device.type == "cuda" else PREFILL_LAUNCHES[:1]
    for launch in launches:
        variants[f"triton {launch[0]}/{launch[1]}/{launch[2]}"] = (
            lambda launch=launch: gpu_attention.paged_prefill(q, layer, tables, starts, lens, lens, None,
                                                              launch=launch))
    with torch.inference_mode():
        ref = sdpa().float()
        out = {}
        for name, fn in variants.items():
            out[name] = {"max_diff": sig((fn().float() - ref).abs().max().item()), "samples_ms": []}
        for _ in range(reps):  # alternating: every variant once per round
            for name, fn in variants.items():
                out[name]["samples_ms"].append(sig(time_ms(fn, ctx.device)))
    for name, r in out.items():
        ms = statistics.median(r["samples_ms"])
        r.update(ms=sig(ms), tflop_per_s=sig(flop / (ms / 1e3) / 1e12))
        log("prefill", f"attention {prompts} x {length}, {name}: {ms:.3f} ms, {r['tflop_per_s']:.4g} TFLOP/s, "
                       f"max |diff| from sdpa {r['max_diff']:.3g}")
    return {"prompts": prompts, "length": length, "flop": flop, "variants": out}
