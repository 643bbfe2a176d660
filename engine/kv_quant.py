"""FP8 KV rows in torch: what ``KVCache`` does on ``write`` and ``gather`` when ``kv_dtype="fp8"``.

The row (``kv_formats.py`` says why this shape)::

    row = head_dim bytes of float8_e4m3fn  |  2 bytes: the row's scale, bfloat16 (little-endian)
    value[d] = float(fp8[d]) * float(scale),   scale = bfloat16(amax(|x|) / 448)

448 is e4m3fn's largest finite value; ``x / scale`` is clamped to +-448 (the scale rounded to
bfloat16 may be a little below amax / 448). An all-zero row gets a tiny positive scale (its values
are 0). The C++ decode kernel (``csrc/paged_decode.cpp``) reads the same bytes.
"""

from __future__ import annotations

import torch

from .fp8 import FP8, FP8_MAX
from .kv_formats import SCALE_BYTES

SCALE_DTYPE = torch.bfloat16
_TINY = 2.0**-120  # the scale of an all-zero row


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
