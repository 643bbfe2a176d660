"""WeightSource: the checkpoint tensors that make one parameter, plain or FP8, checked as they are read.

``WeightSource(get_tensor, expected_shapes, scheme, dtype, device).load(param, hf_names, fp8_capable)``
-> ``(value, scale)``: the tensors named ``hf_names`` concatenated along dim 0 (the q/k/v of one layer
are separate, the experts of a MoE layer many) and

- ``scale is None``: a plain parameter in ``dtype``. FP8 tensors of a parameter that stays plain
  (embeddings, norms, the LM head, a MoE router, a layer whose sources mix FP8 and plain) are
  widened exactly with their ``weight_scale``.
- ``scale`` float32 ``[rows]``: ``value`` is float8_e4m3fn, one scale per output row (``fp8.py``):
  the checkpoint's own FP8 weights and scales (``scheme.in_checkpoint``), or a plain checkpoint's
  weights quantized here (``--quantization fp8``). Only parameters the layer lists in
  ``QUANTIZED_PARAMS`` (its linear projections and experts) are ``fp8_capable``.

Every tensor's shape is checked against config.json, and a tensor that is neither a float dtype nor
FP8 with its scale (an int or uint8 tensor, FP8 in a checkpoint that declares no quantization) is
refused naming it: nothing is cast silently.
"""

from __future__ import annotations

import torch

from . import fp8
from .errors import ModelLoadError
from .quant_config import QuantScheme

# the dtypes a plain (unquantized) checkpoint's tensors may have; anything else is never cast silently
PLAIN_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class WeightSource:
    def __init__(self, get_tensor, expected: dict[str, tuple[int, ...]], scheme: QuantScheme | None,
                 dtype: torch.dtype, device: torch.device):
        self.get_tensor, self.expected, self.scheme = get_tensor, expected, scheme
        self.dtype, self.device = dtype, device
        self.fp8_params = 0  # how many parameters load as FP8
        self.fp8_bytes = 0

    def _read(self, hf_name: str) -> torch.Tensor:
        t = self.get_tensor(hf_name)
        if tuple(t.shape) != self.expected[hf_name]:
            raise shape_error(hf_name, tuple(t.shape), self.expected[hf_name])
        if t.dtype in PLAIN_DTYPES:
            return t
        if t.dtype == fp8.FP8 and self.scheme is not None and self.scheme.in_checkpoint:
            return t
        if self.scheme is None or not self.scheme.in_checkpoint:
            raise ModelLoadError(
                f"weight {hf_name!r} is {_dtype_name(t.dtype)} but config.json declares no quantization (no "
                "quantization_config): refusing to cast it; a quantized checkpoint names its method in config.json")
        raise ModelLoadError(f"weight {hf_name!r} is {_dtype_name(t.dtype)}, not float8_e4m3fn, in a checkpoint "
                             f"quantized by {self.scheme.method}")

    def _scale(self, hf_name: str, rows: int) -> torch.Tensor:
        scale_name = hf_name + "_scale"  # "...q_proj.weight" -> "...q_proj.weight_scale"
        try:
            return fp8.row_scales(self.get_tensor(scale_name), rows, scale_name)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None

    def load(self, param: str, hf_names: list[str], fp8_capable: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        parts = [self._read(n) for n in hf_names]
        is_fp8 = [p.dtype == fp8.FP8 for p in parts]
        if fp8_capable and all(is_fp8):
            weight = _cat([p.view(torch.uint8) for p in parts]).view(fp8.FP8)
            scale = _cat([self._scale(n, p.shape[0]) for n, p in zip(hf_names, parts)])
            return self._fp8(weight, scale)
        if any(is_fp8):  # stays plain: widened exactly with the checkpoint's scales
            parts = [fp8.dequantize(p, self._scale(n, p.shape[0]), torch.float32) if f else p
                     for n, p, f in zip(hf_names, parts, is_fp8)]
        value = _cat(parts)
        if fp8_capable and self.scheme is not None and not self.scheme.in_checkpoint:  # --quantization fp8
            return self._fp8(*fp8.quantize(value))
        return value.to(device=self.device, dtype=self.dtype).contiguous(), None

    def _fp8(self, weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not torch.isfinite(scale).all():
            raise ModelLoadError("an FP8 weight_scale holds a value that is not finite")
        self.fp8_params += 1
        self.fp8_bytes += weight.numel()
        return weight.to(self.device).contiguous(), scale.to(device=self.device, dtype=torch.float32).contiguous()


def shape_error(hf_name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> ModelLoadError:
    return ModelLoadError(f"weight {hf_name!r} has shape {shape}, expected {expected} from config.json")


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
