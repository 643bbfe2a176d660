"""The FP8 KV row: how ``KVCache`` stores one (token, KV head) of K or V when ``kv_dtype="fp8"``.

Contract (the bytes every mover of whole blocks carries without knowing it: the CacheStore, its
checksums, swap, the host/disk tiers, the KV pool)::

    row = head_dim bytes of float8_e4m3fn  |  2 bytes: the row's scale, bfloat16 (little-endian)
    value[d] = float(fp8[d]) * float(scale)

The scale is dynamic, per token per KV head: ``amax(|x|) / 448`` of that row (448 = e4m3fn's
largest finite value), rounded to bfloat16, computed when the token is written. A row never
changes after its token is written, so decode filling a block token by token never re-quantizes
what is there (a per-block scale would have to, whenever a later token exceeds its range), and
each row gets the whole fp8 range: the most accurate of the scale granularities the issue allows.
bfloat16 (not float16) because its range is float32's: a tiny row's scale never underflows to 0.

Bytes per (token, head) against 16-bit K/V: ``2 * head_dim / (head_dim + 2)``: 1.94x at
head_dim 64, 1.97x at 128 (``tokens_per_byte_gain``). The C++ decode kernel
(``csrc/paged_decode.cpp``) reads these rows in place; ``quantize``/``dequantize`` are the torch path.
"""

from __future__ import annotations

import torch

KV_DTYPES = ("auto", "fp8")  # --kv-cache-dtype: auto = the model's dtype, fp8 = these rows
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
SCALE_DTYPE = torch.bfloat16
SCALE_BYTES = 2
_TINY = 2.0**-120  # the scale of an all-zero row (any positive number: its values quantize to 0)


def check_kv_dtype(kv_dtype: str) -> str:
    """``kv_dtype`` if it is one of ``KV_DTYPES``, else ValueError naming the flag and the choices."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    return kv_dtype


def describe(kv_dtype: str, model_dtype: str) -> str:
    """The KV cache's element type in words, for logs and refusals: 'fp8 (float8_e4m3fn + bfloat16
    scales)' or the model dtype ('bfloat16')."""
    return "fp8 (float8_e4m3fn + bfloat16 scale per token per KV head)" if kv_dtype == "fp8" else model_dtype


def row_nbytes(kv_dtype: str, head_dim: int, element_bytes: int) -> int:
    """Bytes of one (token, KV head) row of K or V: ``element_bytes`` is the model dtype's (auto)."""
    return head_dim + SCALE_BYTES if kv_dtype == "fp8" else head_dim * element_bytes


def tokens_per_byte_gain(head_dim: int, element_bytes: int = 2) -> float:
    """How many more tokens an fp8 pool holds than one of ``element_bytes`` per value, in the same bytes."""
    return row_nbytes("auto", head_dim, element_bytes) / row_nbytes("fp8", head_dim, element_bytes)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., D] (any float dtype) -> uint8 rows [..., D + 2]: fp8 values then the bfloat16 scale."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min_(_TINY).to(SCALE_DTYPE)
    values = (xf / scale.float()).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return torch.cat([values.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 rows [..., D + 2] -> values [..., D] in ``dtype`` (arithmetic in float32)."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(SCALE_DTYPE).float()
    return (rows[..., :d].view(FP8).float() * scale).to(dtype)
