"""Linear layers on CPU through oneDNN with weights packed once at load (``pack_linears``).

``F.linear(x, W)`` with ``W`` stored ``[out, in]`` (the checkpoint's layout) runs MKL's
transposed-B GEMM, which on one CPU thread slows down as soon as a decode batch has a few
rows: measured for a 2816 x 1024 fp32 weight, 0.48 ms at 1 row, 0.95 ms at 4 rows, 1.4 ms at
8 (the weights are read once per call either way; the time is the kernel's). oneDNN with the
weight reordered once into its blocked layout takes
0.56 / 0.56 / 0.79 ms at 1 / 4 / 8 rows and the same as F.linear at 512 rows (a prefill).
At 1 to ``PLAIN_MAX_ROWS`` rows F.linear is still the faster one (its GEMV path), so both
are kept and ``linear`` picks by rows; the packed copy doubles the memory of the linear
weights (not of the embeddings, nor of the KV cache).

``pack_linears(model)`` gives every ``nn.Linear`` of a float32/bfloat16 model on CPU with at
least PACK_MIN_ELEMENTS weights a ``packed_weight`` attribute (none, F.linear everywhere, where
oneDNN is missing or the environment sets ``PDSERVE_PACKED_LINEAR=0``: the memory back, the
batch speed lost).
``linear(x, module)`` is ``F.linear(x, module.weight, module.bias)`` in every result.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from .defaults import PACKED_LINEAR_ENV

PACK_BATCH_HINT = 8  # the rows oneDNN's reorder is tuned for (measured best over 2..16 rows)
PLAIN_MAX_ROWS = 3  # up to this many rows F.linear (GEMV-like) is faster than the packed GEMM
# Smaller weights stay on F.linear: oneDNN's fixed cost per call dominates them (measured at 4-8
# rows, packed / F.linear: 64x64 6.4x, 128x1024 2.3x / 1.9x, 512x512 1.6x, 1024x512 1.0x, 1024x1024 0.7-0.8x)
PACK_MIN_ELEMENTS = 1 << 20


def pack_linears(model: nn.Module) -> int:
    """Pack every nn.Linear weight of ``model`` (CPU, float32/bfloat16); returns how many."""
    if not torch.backends.mkldnn.is_available() or os.environ.get(PACKED_LINEAR_ENV, "1") == "0":
        return 0
    packed = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        w = module.weight
        if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16) or w.dim() != 2:
            continue
        if w.numel() < PACK_MIN_ELEMENTS:
            continue
        try:
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_BATCH_HINT)
        except (RuntimeError, AttributeError):  # a torch built without this oneDNN op: stay on F.linear
            return packed
        packed += 1
    return packed


def linear(x: torch.Tensor, module: nn.Linear) -> torch.Tensor:
    """``x @ module.weight.T + module.bias``, through the packed weight when there is one and
    ``x`` has more than PLAIN_MAX_ROWS rows."""
    packed = getattr(module, "packed_weight", None)
    if (packed is None or x.dim() != 2 or x.shape[0] <= PLAIN_MAX_ROWS or x.device.type != "cpu"
            or x.dtype != packed.dtype or x.dtype != module.weight.dtype):  # (a model moved after loading)
        return F.linear(x, module.weight, module.bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, module.bias, "none", [], "")
