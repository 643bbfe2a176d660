"""Gemma 2 and Gemma 3 (text): sandwich norms, (1 + w) RMSNorm, GELU-tanh MLP, scaled embeddings.

Per layer: ``x + post_attention_norm(attn)``, then ``x + post_feedforward_norm(mlp(
pre_feedforward_norm(x)))``. Gemma 3 adds per-head q/k norms (same (1 + w) norm). What the
model does around the layers (embedding scale, attention scale from ``query_pre_attn_scalar``,
soft-capping, sliding windows, Gemma 3's local rotary base) comes from ModelConfig.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .llama import DecoderLayer, Tensors


class GemmaRMSNorm(nn.Module):
    """RMSNorm computed in float32 and scaled by (1 + weight); the checkpoint stores weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GemmaLayer(DecoderLayer):
    norm_class = GemmaRMSNorm
    scales_embeddings = True

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.has_qk_norm = cfg.family == "gemma3"
        if self.has_qk_norm:
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.q_norm(q), self.k_norm(k)) if self.has_qk_norm else (q, k)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.ops.linear(attn, self.o_proj))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    @classmethod
    def checkpoint_tensors(cls, cfg: ModelConfig, index: int) -> Tensors:
        out = super().checkpoint_tensors(cfg, index)
        h = cfg.hidden_size
        out["pre_feedforward_layernorm.weight"] = [("pre_feedforward_layernorm.weight", (h,))]
        out["post_feedforward_layernorm.weight"] = [("post_feedforward_layernorm.weight", (h,))]
        if cfg.family == "gemma3":
            out["q_norm.weight"] = [("self_attn.q_norm.weight", (cfg.head_dim,))]
            out["k_norm.weight"] = [("self_attn.k_norm.weight", (cfg.head_dim,))]
        return out
