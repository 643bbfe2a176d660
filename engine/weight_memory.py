"""How many bytes a model's weights take on its device, and a clear refusal when they cannot fit.

``weight_bytes(cfg, dtype, scheme)`` counts every checkpoint tensor at the size it is loaded in:
``dtype``'s for plain ones, one byte per element (plus a float32 scale per row) for the projections
an FP8 scheme quantizes; a tied LM head once. With a tensor-parallel ``shard`` (``tp/shard.py``) it is
that rank's part: each tensor at the shape the rank loads (heads, MLP rows and LM-head rows divided by
the size, the embedding and norms whole), so the check is per rank, on the rank's own GPU.
``check_fits(need, free, total, where)`` raises ``ModelLoadError`` saying "needs N GiB, M GiB free"
(and what to try) instead of letting a CUDA out-of-memory error end the start-up with a traceback;
``build_within_memory(build, ...)`` (what ``loader.load_model`` builds through) calls it on CUDA before building
the model (``torch.cuda.mem_get_info``), and turns an out-of-memory error during the build into the same
message; on other devices it only builds. ``where(device, shard, whole)``
names the device, and at tensor-parallel size > 1 the rank, the size and the whole model's bytes (a
worker rank's refusal reaches rank 0's log as "tensor-parallel rank R could not start: ...").
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from .checkpoint import hf_tensor_shapes
from .config import ModelConfig
from .errors import ModelLoadError
from .models import layer_class
from .quant_config import QuantScheme
from .tp.shard import Shard

GIB = 1 << 30
T = TypeVar("T")


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype, scheme: QuantScheme | None = None,
                 shard: Shard | None = None) -> int:
    """Bytes of the loaded weights (what ``build_model`` puts on the device); with ``shard`` (``cfg`` the
    whole model's), what that tensor-parallel rank loads."""
    quantized = layer_class(cfg).QUANTIZED_PARAMS if scheme is not None else ()
    sources = {}  # hf name -> our parameter suffix (q_proj.weight, experts_gate_up, ...)
    for i in range(cfg.num_layers):
        for param, tensors in layer_class(cfg).checkpoint_tensors(cfg, i).items():
            for name, _ in tensors:
                sources[f"model.layers.{i}.{name}"] = param
    total = 0
    for name, whole in hf_tensor_shapes(cfg).items():
        shape = whole if shard is None else shard.shape(name, whole)
        elements = 1
        for n in shape:
            elements *= n
        if sources.get(name) in quantized:
            total += elements + 4 * shape[0]  # FP8 bytes and one float32 scale per row
        else:
            total += elements * dtype.itemsize
    return total


def check_fits(need: int, free: int, total: int, where: str) -> None:
    """ModelLoadError naming the sizes when ``need`` bytes of weights exceed ``free``."""
    if need > free:
        raise too_large(need, free, total, where)


def where(device: str, shard: Shard | None = None, whole: int = 0) -> str:
    """The device a check is about: itself at tensor-parallel size 1; else also the rank, the size, and the
    whole model's weight bytes (``whole``), which the size divides."""
    if shard is None or shard.size == 1:
        return device
    return (f"{device} (tensor-parallel rank {shard.rank} of {shard.size}: its shard of the model's "
            f"{whole / GIB:.1f} GiB)")


def too_large(need: int, free: int, total: int, where: str, during: str = "") -> ModelLoadError:
    """The error of a model that does not fit: its sizes, and what to try."""
    more = ("more tensor-parallel ranks (--tensor-parallel-size; an InferenceService pool's parallelism.tensor and "
            "as many GPUs), " if "tensor-parallel rank" in where else "")
    return ModelLoadError(
        f"the model's weights need {need / GIB:.1f} GiB on {where}, {free / GIB:.1f} GiB free of {total / GIB:.1f} "
        f"GiB{during}: use a GPU with more memory, {more}--quantization fp8 (half the weight bytes of bf16), or free "
        "the device (another process holds the rest)")


def build_within_memory(build: Callable[[], T], cfg: ModelConfig, dtype: torch.dtype, scheme: QuantScheme | None,
                        shard: Shard, device: torch.device) -> T:
    """``build()``, after checking on CUDA that the weights fit the free memory: a model too large is refused
    naming the sizes, before anything is allocated, and so is an out-of-memory error while building
    (activations or another process took the margin). At tensor-parallel size N each rank checks its own
    shard on its own GPU, and its refusal names the rank, N and the whole model's size."""
    if device.type != "cuda":
        return build()
    need = weight_bytes(cfg, dtype, scheme, shard)  # this rank's part (the whole model at size 1)
    on = where(str(device), shard, weight_bytes(cfg, dtype, scheme) if shard.size > 1 else need)
    free, total = torch.cuda.mem_get_info(device)
    check_fits(need, free, total, on)
    try:
        return build()
    except torch.cuda.OutOfMemoryError:
        raise too_large(need, free, total, on, " at the start (out of memory while loading)") from None
