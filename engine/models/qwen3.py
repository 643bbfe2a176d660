"""Qwen3: the Llama layer plus an RMSNorm over each head of q and k before rotary."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .llama import DecoderLayer, Tensors


class Qwen3Layer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        self.q_norm = self.norm_class(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = self.norm_class(cfg.head_dim, cfg.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)

    @classmethod
    def checkpoint_tensors(cls, cfg: ModelConfig, index: int) -> Tensors:
        out = super().checkpoint_tensors(cfg, index)
        out["q_norm.weight"] = [("self_attn.q_norm.weight", (cfg.head_dim,))]
        out["k_norm.weight"] = [("self_attn.k_norm.weight", (cfg.head_dim,))]
        return out
