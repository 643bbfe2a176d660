"""Linear layers on CPU through oneDNN or MKL with weights packed once at load (``pack_linears``); the CPU's ops
(``layer_ops.CpuOps``) run the model's plain linear layers through ``linear`` here.

``F.linear(x, W)`` with ``W`` stored ``[out, in]`` (the checkpoint's layout) runs MKL's
transposed-B GEMM, which on one CPU thread slows down as soon as a decode batch has a few
rows: measured for a 2816 x 1024 fp32 weight, 0.48 ms at 1 row, 0.95 ms at 4 rows, 1.4 ms at
8 (the weights are read once per call either way; the time is the kernel's). oneDNN with the
weight reordered once into its blocked layout takes
0.56 / 0.56 / 0.79 ms at 1 / 4 / 8 rows and the same as F.linear at 512 rows (a prefill).
At 1 to ``PLAIN_MAX_ROWS`` rows F.linear is still the faster one (its GEMV path), so both
are kept and ``linear`` picks by rows; the packed copy doubles the memory of the linear
weights (not of the embeddings, nor of the KV cache).

A float32 weight is packed by MKL instead (``mkl_gemm.py``) where MKL's packed GEMM is reachable: at a
prefill's rows oneDNN's copy gains nothing over F.linear, MKL's saves the panel copy F.linear's GEMM
makes on every call, and at decode batches it is as fast as oneDNN's (measured in ``mkl_gemm.py``). Its copy
is larger (about 9 MiB more per matrix). bfloat16 weights keep oneDNN's.

``pack_linears(model)`` gives every ``nn.Linear`` of a float32/bfloat16 model (on CPU: only the CPU's ops
call it, ``layer_ops.CpuOps.prepare``) with at least PACK_MIN_ELEMENTS weights a ``packed_weight`` attribute
(none, F.linear everywhere, where oneDNN is missing; ``unpack_linears`` drops them when
``EngineConfig.packed_linear`` is off: the memory back, the batch speed lost).
``linear(x, module)`` is ``F.linear(x, module.weight, module.bias)`` in every result (a plain weight: FP8
weights and a tensor-parallel rank's ``combine`` are the ops' part, ``layer_ops.py``).

bfloat16 on a CPU without bf16 instructions (neither AVX512-BF16 nor AMX: ``native_bf16()``)
has oneDNN emulate them, and a bf16 GEMM there runs 2.7x slower than the fp32 GEMM of the
same shape at 32 rows, 5x at 128 (one thread, 2816 x 1024). So on such a CPU the packed copy of
a bf16 weight is float32: the rows are widened to fp32, multiplied, and the result rounded to
bf16. That is the arithmetic bf16 hardware does (bf16 x bf16 products are exact in fp32, sums
accumulate in fp32, the output is rounded once); only the order of the sums differs. It costs
twice the bf16 weights' memory instead of once. At one row bf16 ``F.linear`` is as fast and
stays (``UPCAST_PLAIN_MAX_ROWS``). Where oneDNN cannot pack bf16 at all (no AVX-512 nor
AVX-NE-CONVERT), the weights are widened the same way, whatever ``native_bf16()`` says.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from . import mkl_gemm


PACK_BATCH_HINT = 8  # the rows oneDNN's reorder is tuned for (measured best over 2..16 rows)
PLAIN_MAX_ROWS = 3  # up to this many rows F.linear (GEMV-like) is faster than the packed GEMM (MKL's: mkl_gemm.py)
# Smaller weights stay on F.linear: oneDNN's fixed cost per call dominates them (measured at 4-8
# rows, packed / F.linear: 64x64 6.4x, 128x1024 2.3x / 1.9x, 512x512 1.6x, 1024x512 1.0x, 1024x1024 0.7-0.8x)
PACK_MIN_ELEMENTS = 1 << 20
# bf16 widened to fp32 (no bf16 instructions): measured per 2816 x 1024 weight, bf16 F.linear /
# fp32 packed with the casts, ms: 1 row 1.16 / 1.43, 2 rows 1.74 / 1.33, 4 rows 2.45 / 1.72
UPCAST_PLAIN_MAX_ROWS = 1


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX) rather than emulating it."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def pack_linears(model: nn.Module) -> int:
    """Pack every nn.Linear weight of ``model`` (float32/bfloat16, on CPU) not packed yet; returns how many."""
    if not torch.backends.mkldnn.is_available():
        return 0
    packed = 0
    widen_bf16 = not native_bf16()
    for module in model.modules():
        if not isinstance(module, nn.Linear) or getattr(module, "packed_weight", None) is not None:
            continue
        w = module.weight
        if w.dtype not in (torch.float32, torch.bfloat16) or w.dim() != 2:
            continue
        if w.numel() < PACK_MIN_ELEMENTS:
            continue
        if w.dtype == torch.float32 and mkl_gemm.available():
            module.packed_weight = mkl_gemm.pack(w)
        else:
            compute = torch.float32 if w.dtype == torch.bfloat16 and widen_bf16 else w.dtype
            try:
                module.packed_weight = _reorder(w, compute)
            except (RuntimeError, AttributeError):  # a torch built without this oneDNN op: stay on F.linear
                return packed
        module.packed_bias = None if module.bias is None else module.bias.detach().to(module.packed_weight.dtype)
        module.packed_from = w.dtype
        packed += 1
    return packed


def unpack_linears(model: nn.Module) -> None:
    """Drop every packed copy (EngineConfig.packed_linear off: F.linear everywhere, the memory back)."""
    for module in model.modules():
        for attr in ("packed_weight", "packed_bias", "packed_from"):
            if hasattr(module, attr):
                delattr(module, attr)


def _reorder(w: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """oneDNN's packed copy of ``w`` in ``compute``; widened to fp32 instead where oneDNN has no bf16
    GEMM on this CPU (it wants AVX-512 or AVX-NE-CONVERT, e.g. not on AMD Zen 3)."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.detach().to(compute), PACK_BATCH_HINT)
    except RuntimeError:
        if compute != torch.bfloat16:
            raise
        return torch.ops.mkldnn._reorder_linear_weight(w.detach().float(), PACK_BATCH_HINT)


def linear(x: torch.Tensor, module: nn.Linear) -> torch.Tensor:
    """``x @ module.weight.T + module.bias``, through the packed weight when there is one and ``x`` has
    enough rows (more than PLAIN_MAX_ROWS, or UPCAST_PLAIN_MAX_ROWS when widened)."""
    packed = getattr(module, "packed_weight", None)
    if (packed is None or x.dim() != 2 or x.dtype != module.packed_from
            or module.weight.dtype != module.packed_from):  # (a model cast after loading)
        return F.linear(x, module.weight, module.bias)
    widened = packed.dtype != x.dtype
    if x.shape[0] <= (UPCAST_PLAIN_MAX_ROWS if widened else PLAIN_MAX_ROWS):
        return F.linear(x, module.weight, module.bias)
    rows = x.to(packed.dtype).contiguous()
    if isinstance(packed, mkl_gemm.PackedWeight):
        return mkl_gemm.linear(rows, packed, module.packed_bias)  # (float32 in and out: never widened)
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, module.packed_bias, "none", [], "")
    return out.to(x.dtype)
