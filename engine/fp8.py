"""FP8 (e4m3) linear weights: quantized at load, and the matmul each device runs on them.

A quantized weight is float8_e4m3fn ``[out, in]`` with one float32 scale per output row (``[out]``;
a checkpoint's per-tensor scale is repeated per row): the real weight is ``w * scale[:, None]``.
The loader (``loader.py``) installs it on its module as ``weight`` (or ``experts_*``) beside a
``*_scale`` buffer. ``linear_for(device)`` is the matmul ``x @ (w * scale).T + bias`` that ``device`` runs,
chosen once per model (``layer_ops.choose``: the layers call it through ``self.ops``, never asking the device):

- CPU (``cpu_linear``): up to ``FEW_ROWS`` rows (a decode step), the C++ kernel reads the FP8 bytes in place
  (``engine/csrc/fp8_linear.cpp``): half the weight bytes of bf16 per step. More rows (a prefill, a big
  batch): the weight is widened into a buffer kept across calls, then one GEMM. Without the kernel
  (no g++): widened per call in torch, slowly (a warning at load says so).
- CUDA with FP8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell; ``tensor_core_linear``):
  activations quantized per token at run time, ``torch._scaled_mm`` with row-wise scales, bf16 out (a weight
  whose sides are not multiples of 16 widened instead).
- other GPUs (Ampere) and devices (``widened_linear``): widened per call (the weights stay FP8 in memory).

``describe(device)`` is the one line a server logs at start saying which of these it runs.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable

import torch
import torch.nn.functional as F

from . import native

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
# Up to this many rows the kernel reads FP8 in place; above, widening + one GEMM is faster. Measured per call
# (2816 x 1024, bf16 rows, one thread, Intel Xeon with AMX): kernel / widen+GEMM / bf16 F.linear, ms:
# 1 row 0.19 / 0.79 / 0.26, 4 rows 0.31 / 1.00 / 0.45, 8 rows 0.56 / 0.95 / 0.43, 12 rows 0.83 / 0.94 / 0.42,
# 16 rows 1.10 / 0.96 / 0.43: FP8 is faster than bf16 up to 4 rows and slower from 8 (bf16 has AMX here).
# Tried and dropped: bf16 rows through AVX512-BF16's vdpbf16ps (32 pairs per instruction) measured slower,
# 0.28 / 0.52 / 0.90 ms at 1 / 4 / 8 rows, than the float32 FMAs' 0.19 / 0.29 / 0.56 on the same CPU.
FEW_ROWS = 12
SCALED_MM_CAPABILITY = (8, 9)
_scratch = threading.local()  # per thread: dtype -> the widening buffer (the largest weight seen)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [out, in] -> (FP8 weight, float32 scale [out]): per output row, amax maps to FP8_MAX."""
    w32 = w.float()
    scale = (w32.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (w32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def row_scales(scale: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """A checkpoint's ``weight_scale`` (one value, or one per output row) -> float32 ``[rows]``."""
    flat = scale.float().reshape(-1)
    if flat.numel() == 1:
        return flat.expand(rows).contiguous()
    if flat.numel() == rows and scale.dim() <= 2 and (scale.dim() < 2 or scale.shape[1] == 1):
        return flat.contiguous()
    raise ValueError(f"{name} has shape {tuple(scale.shape)}: expected one value (per-tensor) or one per "
                     f"output row ({rows}, per-channel)")


def dequantize(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``w * scale[:, None]`` computed in float32 (exact), then cast to ``dtype`` once."""
    return (w.float() * scale[:, None]).to(dtype)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def scaled_mm_capable(device: torch.device) -> bool:
    """Whether ``device`` has FP8 tensor cores (CUDA compute capability 8.9+)."""
    if device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) \
        >= SCALED_MM_CAPABILITY


def linear_for(device: torch.device) -> Callable[..., torch.Tensor]:
    """The FP8 matmul ``(x, w, scale, bias) -> x @ (w * scale[:, None]).T + bias`` (in ``x``'s dtype) that
    ``device`` runs: asked once per model (``layer_ops.choose``), not per call."""
    if device.type == "cpu":
        return cpu_linear
    if scaled_mm_capable(device):
        return tensor_core_linear
    return widened_linear


def widened_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias=None) -> torch.Tensor:
    """The weight widened to ``x``'s dtype for this call, then ``F.linear`` (any device)."""
    return F.linear(x, dequantize(w, scale, x.dtype), bias)


def tensor_core_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias=None) -> torch.Tensor:
    """``scaled_mm_linear`` where ``_scaled_mm`` takes the weight's shape (sides of 16), else widened."""
    if w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0:
        return scaled_mm_linear(x, w, scale, bias)
    return widened_linear(x, w, scale, bias)


def scaled_mm_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias=None) -> torch.Tensor:
    """FP8 x FP8 on tensor cores: ``x``'s rows quantized with one scale each (dynamic, per token)."""
    rows = x.reshape(-1, x.shape[-1])
    amax = rows.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    x_scale = amax / FP8_MAX
    xq = (rows.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    out = torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=torch.bfloat16,
                           bias=None if bias is None else bias.to(torch.bfloat16))
    return out.to(x.dtype).view(*x.shape[:-1], w.shape[0])


def cpu_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias=None) -> torch.Tensor:
    """The CPU's FP8 matmul: the C++ kernel on the FP8 bytes at up to ``FEW_ROWS`` rows, one GEMM on the weight
    widened into this thread's buffer above; widened per call in torch without the kernel."""
    ops = native.fp8_ops()
    compute = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
    rows = x.reshape(-1, x.shape[-1])
    if ops is None:
        return F.linear(x, dequantize(w, scale, x.dtype), bias)
    if rows.shape[0] <= FEW_ROWS:
        out = ops.fp8_linear(rows.to(compute).contiguous(), w.view(torch.uint8), scale, bias)
    else:
        wide = ops.fp8_dequantize(w.view(torch.uint8), scale, _buffer(w.shape, compute))
        out = F.linear(rows.to(compute), wide, None if bias is None else bias.to(compute))
    return out.to(x.dtype).view(*x.shape[:-1], w.shape[0])


def _buffer(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A [out, in] view of this thread's widening buffer (grown to the largest weight, never shrunk)."""
    buffers = getattr(_scratch, "by_dtype", None)
    if buffers is None:
        buffers = _scratch.by_dtype = {}
    need = shape[0] * shape[1]
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < need:
        buf = buffers[dtype] = torch.empty(need, dtype=dtype)
    return buf[:need].view(shape)


def describe(device: torch.device) -> str:
    """How FP8 weights are multiplied on ``device`` (the server's start-up line)."""
    if device.type == "cpu":
        if native.fp8_ops() is None:
            return f"widened to the compute dtype per call in torch (slow: the C++ kernel is unavailable: " \
                   f"{native.fp8_unavailable_reason()})"
        return (f"read in place by the C++ kernel at up to {FEW_ROWS} rows (decode), widened into a buffer for "
                "a GEMM at more (prefill)")
    if scaled_mm_capable(device):
        return "FP8 tensor cores (torch._scaled_mm), activations quantized per token at run time"
    return "widened per call (this GPU has no FP8 tensor cores: compute capability below 8.9)"
