"""Qwen3-MoE: the Qwen3 layer whose MLP is a router (softmax, top-k, optionally renormalised)
over ``num_experts`` gated MLPs, on the layers ``ModelConfig.is_moe_layer`` names (the others
keep a dense MLP).

The experts are stored stacked, as the checkpoint's per-expert tensors concatenated: gate and
up of expert e are rows ``[e*2I, e*2I+I)`` and ``[e*2I+I, (e+1)*2I)`` of ``experts_gate_up``;
its down projection is rows ``[e*H, (e+1)*H)`` of ``experts_down``. Each expert runs once per
step on the tokens routed to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .llama import Tensors
from .qwen3 import Qwen3Layer


class Qwen3MoeLayer(Qwen3Layer):
    QUANTIZED_PARAMS = (*Qwen3Layer.QUANTIZED_PARAMS, "experts_gate_up", "experts_down")

    def build_mlp(self, cfg: ModelConfig, index: int) -> None:
        self.sparse = cfg.is_moe_layer(index)
        if not self.sparse:
            return super().build_mlp(cfg, index)
        self.graph_capturable = False  # mlp() picks the experts to run on the host (torch.unique(...).tolist())
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.router = nn.Linear(h, e, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(e * 2 * i, h))
        self.experts_down = nn.Parameter(torch.empty(e * h, i))

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        if not self.sparse:
            return super().mlp(h)
        cfg = self.cfg
        e, i = cfg.num_experts, cfg.moe_intermediate_size
        probs = torch.softmax(F.linear(h, self.router.weight), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)  # [T, k]
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(h.dtype)
        gate_up = self.experts_gate_up.view(e, 2 * i, -1)
        down = self.experts_down.view(e, -1, i)
        # FP8 experts (fp8.py): one scale per row, sliced as the rows are
        gate_up_scale = getattr(self, "experts_gate_up_scale", None)
        down_scale = getattr(self, "experts_down_scale", None)
        out = torch.zeros_like(h)
        for expert in torch.unique(experts).tolist():
            tokens, slot = torch.where(experts == expert)
            gs = None if gate_up_scale is None else gate_up_scale.view(e, -1)[expert]
            ds = None if down_scale is None else down_scale.view(e, -1)[expert]
            gate, up = self.ops.matmul(h[tokens], gate_up[expert], None, gs).chunk(2, dim=-1)
            y = self.ops.matmul(self.act(gate) * up, down[expert], None, ds) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y)
        combine = self.__dict__.get("combine")  # tensor parallelism: every rank's slice of the experts summed (tp/)
        return out if combine is None else combine(out)

    @classmethod
    def mlp_tensors(cls, cfg: ModelConfig, index: int) -> Tensors:
        if not cfg.is_moe_layer(index):
            return super().mlp_tensors(cfg, index)
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        gate_up: list[tuple[str, tuple[int, ...]]] = []
        down: list[tuple[str, tuple[int, ...]]] = []
        for x in range(cfg.num_experts):
            gate_up += [(f"mlp.experts.{x}.gate_proj.weight", (i, h)), (f"mlp.experts.{x}.up_proj.weight", (i, h))]
            down.append((f"mlp.experts.{x}.down_proj.weight", (h, i)))
        return {
            "router.weight": [("mlp.gate.weight", (cfg.num_experts, h))],
            "experts_gate_up": gate_up,
            "experts_down": down,
        }
