"""Hugging Face checkpoint layout: tensor names, random weights, and writing safetensors.

``hf_tensor_shapes(cfg)`` says which tensors a checkpoint holds and their shapes (each
layer's from its family's ``checkpoint_tensors`` in ``engine/models/``); the loader checks
checkpoints against it, and tests/benchmarks use ``random_hf_weights`` +
``save_hf_checkpoint`` to write Llama/Qwen2 checkpoints that transformers and our loader both
read (the other families' test checkpoints are written by transformers).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import ModelConfig
from .models import layer_class


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the checkpoint -> its shape (lm_head only when not tied)."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    layer_cls = layer_class(cfg)
    for i in range(cfg.num_layers):
        for sources in layer_cls.checkpoint_tensors(cfg, i).values():
            shapes.update((f"model.layers.{i}.{name}", shape) for name, shape in sources)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def random_hf_weights(cfg: ModelConfig, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Deterministic random weights for every checkpoint tensor (norms around 1, float32)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in hf_tensor_shapes(cfg).items():
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            out[name] = std * torch.randn(shape, generator=gen)
    return out


def save_hf_checkpoint(
    weights: dict[str, torch.Tensor], cfg: ModelConfig, directory: str | Path, num_shards: int = 1
) -> Path:
    """Write config.json and the weights as one model.safetensors or ``num_shards`` shards + index."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    names = list(weights)
    if num_shards <= 1:
        save_file({n: weights[n].contiguous() for n in names}, str(directory / "model.safetensors"))
        return directory
    weight_map = {}
    per = -(-len(names) // num_shards)
    for s in range(num_shards):
        part = names[s * per : (s + 1) * per]
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: weights[n].contiguous() for n in part}, str(directory / fname))
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return directory
