"""What perf.py (the decode and prefill sections) and probes.py (beside them) share: the plan's model
config, a decode cell (its KV, rows and DecodeGraphs), the timing of its steps and the roofline
figures of a step time."""

from __future__ import annotations

from dataclasses import dataclass

from checklib import sig, time_median


def model_config(plan):
    from pdserve.engine import ModelConfig

    return ModelConfig(**plan.model_shape)


@dataclass
class DecodeCell:
    """The KV, rows and DecodeGraphs of one batch x context cell, ready to step."""

    kv: object
    rows: list
    graphs: object
    attention: str
    kv_alloc_bytes: int

    def step(self):
        return self.graphs.run(self.rows)


def time_steps(ctx, cell: DecodeCell) -> tuple[float, list[float]]:
    import torch

    with torch.inference_mode():
        return time_median(cell.step, ctx.device, ctx.plan.decode_steps, ctx.plan.decode_warmup)


def roofline(ms: float, bytes_read: int, copy_gbps: float | None) -> dict:
    gbps = bytes_read / (ms / 1e3) / 1e9
    return {"ms": sig(ms), "gb_per_s": sig(gbps), "fraction_of_copy": None if not copy_gbps else sig(gbps / copy_gbps)}


def fmt_step(r: dict) -> str:
    frac = r.get("fraction_of_copy")
    return f"{r['ms']:.3f} ms, {r['gb_per_s']:.4g} GB/s" + ("" if frac is None else f" = {100 * frac:.0f}% of copy")
