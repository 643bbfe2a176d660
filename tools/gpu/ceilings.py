"""Section 1, ceilings: what this device can do at best, the yardsticks of the later sections.

- **copy bandwidth**: ``dst.copy_(src)`` of two ``plan.copy_bytes`` buffers (2 GiB on a GPU);
  bytes moved = read + written = 2 x the buffer; GB/s (1e9) from the median of ``plan.ceiling_reps``
  timed copies after ``plan.ceiling_warmup`` untimed ones. A decode step's "fraction of copy
  bandwidth" is measured against this.
- **dense GEMM rate**: ``a @ b`` of two n x n matrices in the run's dtype (bf16 on a GPU, n = 8192):
  2 n^3 FLOP per product; TFLOP/s from the median the same way. Prefill's "fraction of the GEMM
  rate" is measured against this.
"""

from __future__ import annotations

from checklib import Budget, Record, log, release, sig, time_median


def run(ctx, rec: Record, budget: Budget) -> None:
    import torch

    dev, plan = ctx.device, ctx.plan
    n_bytes = plan.copy_bytes
    log("ceilings", f"copy bandwidth: {n_bytes / 2**20:.0f} MiB buffers, {plan.ceiling_reps} timed copies")
    ms, samples = _time_copy(torch, dev, n_bytes, plan)  # the buffers are freed on return
    gbps = 2 * n_bytes / (ms / 1e3) / 1e9
    rec.results["copy"] = {"buffer_bytes": n_bytes, "bytes_moved": 2 * n_bytes, "ms": sig(ms),
                           "gb_per_s": sig(gbps), "samples_ms": samples}
    rec.save()
    log("ceilings", f"copy: {ms:.3f} ms per copy, {gbps:.4g} GB/s (read + written)")
    release(dev)
    if budget.left() <= 0:
        rec.skip("gemm", "budget spent")
        return
    n, dtype = plan.gemm_n, ctx.dtype
    log("ceilings", f"dense GEMM {n}^3 in {str(dtype).split('.')[-1]}, {plan.ceiling_reps} timed")
    ms, samples = _time_gemm(torch, dev, n, dtype, plan)
    tflops = 2 * n**3 / (ms / 1e3) / 1e12
    rec.results["gemm"] = {"n": n, "dtype": str(dtype).split(".")[-1], "ms": sig(ms),
                           "tflop_per_s": sig(tflops), "samples_ms": samples}
    rec.save()
    log("ceilings", f"gemm: {ms:.3f} ms per product, {tflops:.4g} TFLOP/s")
    release(dev)


def _time_copy(torch, dev, n_bytes: int, plan):
    src = torch.empty(n_bytes, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    return time_median(lambda: dst.copy_(src), dev, plan.ceiling_reps, plan.ceiling_warmup)


def _time_gemm(torch, dev, n: int, dtype, plan):
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    c = torch.empty(n, n, device=dev, dtype=dtype)
    return time_median(lambda: torch.matmul(a, b, out=c), dev, plan.ceiling_reps, plan.ceiling_warmup)
