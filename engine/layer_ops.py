"""The ops a decoder layer runs around attention, one object per kind, chosen once per model (``choose``: by
device and the engine's switches; the loader calls it when it builds the model, ``DecoderModel.configure``
when the engine sets its switches) and held by the model, its layers and its norms as ``self.ops``. The
model code calls ``self.ops.rms_norm(...)``, ``self.ops.linear(...)``: it never asks which device it runs on.

- ``TorchOps``: torch's forms of RMSNorm, rotary and act(gate)*up; ``linear`` is ``F.linear``, an FP8 weight
  through the FP8 matmul ``fp8.linear_for`` gave for the device. The reference; any other device.
- ``CpuOps``: ``TorchOps`` whose plain linears take packed copies (MKL or oneDNN) at batch sizes where they are
  faster (``packed_linear.py``), which ``prepare`` makes or drops (``EngineConfig.packed_linear``); q|k|v and
  gate|up stay separate matrices (merged ones measured slower on CPU: ``model.py``).
- ``CudaOps``: ``TorchOps`` with q|k|v and gate|up merged at load (``merges_projections``: one matmul instead
  of three and two, ``DecoderLayer.merge_projections``); eager torch ops between the matmuls.
- ``TritonOps``: ``CudaOps`` with RMSNorm, rotary and silu*mul as one Triton kernel each
  (``gpu_elementwise.py``): CUDA, Triton importable and ``EngineConfig.fused_elementwise`` on.

A second CUDA backend (FlashInfer's fused norm and rotary, say) is a class here and a line in ``choose``; the
model code does not change. The attention over the paged cache is the other seam (``attention_backends.py``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import fp8, gpu_elementwise, packed_linear, triton_jit


class TorchOps:
    name = "torch"
    merges_projections = False  # the loader merges q|k|v and gate|up for these ops

    def __init__(self, fp8_linear: Callable[..., torch.Tensor] = fp8.widened_linear):
        self.fp8_linear = fp8_linear  # (x, w, scale, bias) for an FP8 weight: fp8.linear_for(the device)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """transformers' LlamaRMSNorm: float32 statistics, the normalized row rounded to x's dtype, times weight."""
        dtype = x.dtype
        if dtype == torch.float32:  # one fused kernel, same result as below
            return F.rms_norm(x, weight.shape, weight, eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(dtype)

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D]; cos/sin [T, 1, D] (the half-split convention of Llama checkpoints)."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @staticmethod
    def act_mul(gate_up: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``act(gate) * up`` of a merged gate|up projection's output (gate the first half of the columns)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate).mul_(up)

    def linear(self, x: torch.Tensor, module: nn.Linear) -> torch.Tensor:
        """``x @ module.weight.T + module.bias`` (an FP8 weight: its ``weight_scale`` beside it). A
        tensor-parallel rank's projection that holds part of a sum or of the vocabulary has its output
        combined across ranks by ``module.combine`` (``tp/group.py``: the all-reduce, the LM head's gather)."""
        out = self._linear(x, module)
        combine = module.__dict__.get("combine")  # (a plain dict read: no nn.Module __getattr__ per call)
        return out if combine is None else combine(out)

    def _linear(self, x: torch.Tensor, module: nn.Linear) -> torch.Tensor:
        w = module.weight
        if w.dtype == fp8.FP8:
            return self.fp8_linear(x, w, module.weight_scale, module.bias)
        return F.linear(x, w, module.bias)

    def matmul(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
               scale: torch.Tensor | None) -> torch.Tensor:
        """``x @ w.T + bias`` for a bare weight (merged projections, MoE experts): FP8 when ``scale`` is given."""
        return F.linear(x, w, bias) if scale is None else self.fp8_linear(x, w, scale, bias)

    def prepare(self, model: nn.Module, packed: bool) -> None:
        """Ready ``model``'s weights for these ops (once, when they are chosen): no packed copies here."""
        packed_linear.unpack_linears(model)


class CpuOps(TorchOps):
    name = "cpu"

    def _linear(self, x: torch.Tensor, module: nn.Linear) -> torch.Tensor:
        if module.weight.dtype == fp8.FP8:
            return self.fp8_linear(x, module.weight, module.weight_scale, module.bias)
        return packed_linear.linear(x, module)

    def prepare(self, model: nn.Module, packed: bool) -> None:
        """The packed (MKL or oneDNN) copies of the linear weights (``packed``: EngineConfig.packed_linear), or none."""
        if packed:
            packed_linear.pack_linears(model)
        else:
            packed_linear.unpack_linears(model)


class CudaOps(TorchOps):
    name = "cuda"
    merges_projections = True


class TritonOps(CudaOps):
    name = "triton"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return gpu_elementwise.rms_norm(x, weight, eps)

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return gpu_elementwise.rope(x, cos, sin)

    @staticmethod
    def act_mul(gate_up: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if act is F.silu:  # (the kernel is SiLU's; GELU-tanh layers keep the torch ops)
            return gpu_elementwise.silu_mul(gate_up)
        return TorchOps.act_mul(gate_up, act)


TORCH = TorchOps()  # a layer's ops until its model's are chosen (a layer or norm built by hand: tests, probes)


def choose(device: torch.device | str, fused_elementwise: bool = True) -> TorchOps:
    """The ops of a model on ``device``, once: CPU -> CpuOps; CUDA -> TritonOps where Triton imports and
    ``fused_elementwise`` (EngineConfig's) is on, else CudaOps; any other device -> TorchOps. Each holds
    the FP8 matmul the device runs (``fp8.linear_for``)."""
    device = torch.device(device)
    fp8_linear = fp8.linear_for(device)
    if device.type == "cpu":
        return CpuOps(fp8_linear)
    if device.type != "cuda":
        return TorchOps(fp8_linear)
    if fused_elementwise and triton_jit.available():
        return TritonOps(fp8_linear)
    return CudaOps(fp8_linear)
