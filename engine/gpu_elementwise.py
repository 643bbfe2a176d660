"""Triton kernels for the per-token work around the matmuls on CUDA: RMSNorm, rotary, SiLU-and-multiply.

A decode step of a small batch is bound by kernel count, not bytes: the torch forms of Llama's
RMSNorm (float cast, square, mean, add, rsqrt, multiply, cast back, weight: 8 kernels) and of the
rotary embedding (negate, concatenate, two products, a sum: 5 kernels per tensor) are about 26 of
a layer's ~40 launches, each a few microseconds even inside a CUDA graph. Each is one kernel here
(measured on an H200: a decode step of the 8B shape 1.27x faster at batch 1, 1.32x at batch 32):

* ``rms_norm(x, weight, eps)``: one program per row; the same roundings as transformers'
  ``LlamaRMSNorm`` (sum of squares and rsqrt in float32, the normalized row rounded to x's dtype,
  then multiplied by the weight and rounded to the promoted dtype); only the order of the float32
  sum differs.
* ``rope(x, cos, sin)``: x ``[T, heads, D]``, cos/sin ``[T, 1, D]`` in x's dtype (``DecoderModel.rope``);
  one program per token over all its heads; ``x * cos + rotate_half(x) * sin`` with each product
  and the sum rounded to x's dtype, as the torch ops do it.
* ``silu_mul(gate_up)``: the gated MLP's ``silu(gate) * up`` on the merged gate|up projection
  (``DecoderLayer.merge_projections``), one kernel where torch runs two over strided halves.

The layers run them through ``layer_ops.TritonOps``, the ops ``layer_ops.choose`` gives a CUDA model once
(Triton importable, ``EngineConfig.fused_elementwise`` on: the A/B switch of the GPU check); they never ask
per call. The tests run the bodies on CPU tensors under Triton's interpreter against the torch forms
(``layer_ops.TorchOps``; ``triton_jit.py``).
"""

from __future__ import annotations


import torch

from . import triton_jit


def _rms_norm(X, W, OUT, eps, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    var = tl.reduce(x * x, 0, tl.standard._sum_combine) / n_cols
    y = (x * (1.0 / tl.sqrt(var + eps))).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (y * w).to(OUT.dtype.element_ty), mask=ok)


def _rope(X, COS, SIN, OUT, n_heads, stride_xt, stride_xh, stride_ct, stride_st, stride_ot, stride_oh,
          HALF: tl.constexpr, HALF_P: tl.constexpr, HEADS_P: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_P)[:, None]
    d = tl.arange(0, HALF_P)[None, :]
    ok = (heads < n_heads) & (d < HALF)
    d_ok = d < HALF
    xb = X + t * stride_xt + heads * stride_xh + d
    x1 = tl.load(xb, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(xb + HALF, mask=ok, other=0.0).to(tl.float32)
    c1 = tl.load(COS + t * stride_ct + d, mask=d_ok, other=0.0).to(tl.float32)
    c2 = tl.load(COS + t * stride_ct + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + t * stride_st + d, mask=d_ok, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + t * stride_st + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    ty = OUT.dtype.element_ty
    o1 = (x1 * c1).to(ty).to(tl.float32) + ((0.0 - x2) * s1).to(ty).to(tl.float32)
    o2 = (x2 * c2).to(ty).to(tl.float32) + (x1 * s2).to(ty).to(tl.float32)
    ob = OUT + t * stride_ot + heads * stride_oh + d
    tl.store(ob, o1.to(ty), mask=ok)
    tl.store(ob + HALF, o2.to(ty), mask=ok)


def _silu_mul(GU, OUT, n_cols, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(GU + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_g + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    ty = OUT.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (act * u).to(ty), mask=ok)


_BODIES = (_rms_norm, _rope, _silu_mul)
_SILU_BLOCK = 1024


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (any leading shape) scaled by ``weight``."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight {tuple(weight.shape)} does not fit rows of {n}")
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows.shape[0]:
        kernels = triton_jit.kernels(_BODIES, x.device.type == "cpu")
        kernels.rms_norm[(rows.shape[0],)](rows, weight, out, float(eps), n, rows.stride(0), out.stride(0),
                                           BLOCK=_pow2(n), num_warps=4 if n <= 4096 else 8)
    return out.view(*x.shape[:-1], n)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for x ``[T, heads, D]`` and cos/sin ``[T, 1, D]`` (x's dtype)."""
    if x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"x must be [tokens, heads, even head_dim], got {tuple(x.shape)}")
    t, heads, dim = x.shape
    for name, c in (("cos", cos), ("sin", sin)):
        if c.shape != (t, 1, dim) or c.dtype != x.dtype:
            raise ValueError(f"{name} must be [{t}, 1, {dim}] in {x.dtype}, got {tuple(c.shape)} {c.dtype}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    out = torch.empty((t, heads, dim), dtype=x.dtype, device=x.device)
    if t:
        kernels = triton_jit.kernels(_BODIES, x.device.type == "cpu")
        half = dim // 2
        kernels.rope[(t,)](x, cos, sin, out, heads, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
                           out.stride(0), out.stride(1), HALF=half, HALF_P=_pow2(half), HEADS_P=_pow2(heads),
                           num_warps=4)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for the merged MLP projection ``gate_up`` ``[T, 2 * I]`` (gate the first I
    columns) -> ``[T, I]``; silu rounded to the dtype, then the product, as the torch ops do it."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [tokens, 2 * intermediate], got {tuple(gate_up.shape)}")
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    if t:
        kernels = triton_jit.kernels(_BODIES, gate_up.device.type == "cpu")
        kernels.silu_mul[(t, -(-n // _SILU_BLOCK))](gate_up, out, n, gate_up.stride(0), out.stride(0),
                                                    BLOCK=_SILU_BLOCK, num_warps=4)
    return out
