"""Tiny random checkpoints of the newer model families, written by transformers itself.

``save_tiny(family, directory, seed)`` builds the transformers model from a small config
(hidden 64, 3 layers, a sliding window shorter than the test prompts where the family has
one, soft-capping small enough to bite), draws seeded random weights large enough that greedy
tokens are not near-ties, and ``save_pretrained``s it (safetensors) -> the directory.
"""

from __future__ import annotations

from pathlib import Path

import torch

WINDOW = 12  # shorter than the test prompts, so prefill and decode both cross it
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
FAMILIES = {
    # q/k norms; sliding window on layers >= 1 (max_window_layers); untied embeddings
    "qwen3": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1000.0})),
    # (1+w) norms, sandwich norms, embedding scale, attention + final soft-capping, alternating window
    "gemma2": ("Gemma2Config", dict(query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=2.0,
                                    final_logit_softcapping=3.0)),
    # q/k (1+w) norms, local/global rope bases (global scaled), final soft-capping, explicit layer types
    "gemma3": ("Gemma3TextConfig", dict(query_pre_attn_scalar=24, sliding_window=WINDOW, final_logit_softcapping=3.0,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        rope_parameters={
                                            "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": 500.0},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # router top-2 of 4 experts, renormalised; layer 1 dense (mlp_only_layers)
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=True, mlp_only_layers=[1])),
}
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}


def build_tiny(family: str, seed: int = 0, std: float = 0.15):
    """The transformers model (float32, eval) of ``family`` with seeded random weights."""
    config_cls, extra = FAMILIES[family]
    return build_from_config(config_cls, extra, ARCHITECTURES[family], seed, std)


def build_from_config(config_cls: str, extra: dict, architecture: str, seed: int = 0, std: float = 0.15):
    """A tiny transformers model (``COMMON`` sizes plus ``extra``; float32, eval) with seeded random
    weights: std ``std``, norms around their identity (Gemma's (1 + w) norms around 0). Also used by
    the GPU check (tools/gpu/parity.py) for the families these tests do not build."""
    import transformers

    config = getattr(transformers, config_cls)(**COMMON, **extra)
    config.architectures = [architecture]
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    gemma = config_cls.startswith("Gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:  # Gemma stores w of (1 + w); the others w itself
                p.copy_(0.1 * noise if gemma else 1.0 + 0.1 * noise)
            else:
                p.copy_(std * noise)
    return model


def save_tiny(family: str, directory: str | Path, seed: int = 0) -> Path:
    directory = Path(directory)
    build_tiny(family, seed).save_pretrained(str(directory), safe_serialization=True)
    return directory
