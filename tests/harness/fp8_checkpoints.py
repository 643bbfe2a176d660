"""FP8 checkpoints in the published layouts, made from any plain checkpoint by our own code.

``quantize_checkpoint(src, dst, fmt, reference=None)`` reads ``src``'s safetensors and writes ``dst``
with every decoder projection (``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, each
expert's) as float8_e4m3fn plus its ``weight_scale``, and config.json's ``quantization_config``:

- ``"ct-channel"``: llm-compressor's compressed-tensors ``float-quantized``, one scale per output row
  (``weight_scale`` [out, 1]), dynamic per-token input activations (FP8_DYNAMIC);
- ``"ct-tensor"``: the same with one scale per tensor (``weight_scale`` [1]) and a static
  ``input_scale`` (llm-compressor's FP8 with calibration);
- ``"fp8"``: vLLM/AutoFP8's ``quant_method: fp8`` (``weight_scale`` a scalar, dynamic activations).

Everything else (embeddings, norms, LM head, a MoE router: ``mlp.gate``) is copied as it is.
``reference``: also write the dequantized model there (the FP8 values times their scales, float32,
no quantization_config): the model the FP8 one must match.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

PROJECTION = re.compile(r".*\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)\.weight$")
FORMATS = ("ct-channel", "ct-tensor", "fp8")
FP8_MAX = 448.0


def _quantization_config(fmt: str) -> dict:
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    channel = fmt == "ct-channel"
    acts = ({"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True} if channel
            else {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True})
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": acts, "output_activations": None,
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel" if channel else "tensor",
                            "symmetric": True, "dynamic": False}}},
            "ignore": ["lm_head", "re:.*mlp.gate$"], "kv_cache_scheme": None}


def _quantize(w: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True) if per_row else w.abs().amax().reshape(1, 1)
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_checkpoint(src: str | Path, dst: str | Path, fmt: str, reference: str | Path | None = None) -> Path:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    src, dst = Path(src), Path(dst)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    quantized, dequantized = {}, {}
    for name, t in tensors.items():
        if not PROJECTION.match(name):
            quantized[name], dequantized[name] = t.contiguous(), t.float().contiguous()
            continue
        w8, scale = _quantize(t, per_row=fmt == "ct-channel")
        quantized[name] = w8
        if fmt == "ct-channel":
            quantized[name + "_scale"] = scale  # [out, 1]
        elif fmt == "ct-tensor":
            quantized[name + "_scale"] = scale.reshape(1)
            quantized[name.removesuffix("weight") + "input_scale"] = torch.tensor([0.05])
        else:
            quantized[name + "_scale"] = scale.reshape(())
        dequantized[name] = (w8.float() * scale).contiguous()
    hf = json.loads((src / "config.json").read_text())
    _write(src, dst, quantized, {**hf, "quantization_config": _quantization_config(fmt)})
    if reference is not None:
        _write(src, Path(reference), dequantized, {**hf, "torch_dtype": "float32"})
    return dst


def _write(src: Path, dst: Path, tensors: dict, hf_config: dict) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(hf_config, indent=2))
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / extra).exists():
            shutil.copy(src / extra, dst / extra)
