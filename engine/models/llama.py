"""Llama, Mistral, Qwen2: the base decoder layer (pre-norm attention + gated MLP) the others extend.

A layer is used by ``DecoderModel`` through ``qkv(x, cos, sin) -> q, k, v`` (after the input
norm, projections, any q/k norm, rotary) and ``finish(x, attn) -> x`` (output projection,
residuals, MLP); the model runs attention over the paged cache in between. ``window`` (sliding
window or None) and ``rope_local`` (Gemma 3's local rotary table) tell it how.

``checkpoint_tensors(cfg, i)`` is the one place that names a layer's checkpoint tensors: our
parameter -> the Hugging Face tensors (suffixes after ``model.layers.{i}.``) with their shapes,
concatenated along dim 0 when there are several (the experts of a MoE layer).

The per-token ops (norms, rotary, act*mul, the linear layers) are ``self.ops``'s (``layer_ops.py``: torch's,
the CPU's packed linears, CUDA's Triton kernels), chosen once for the model by the loader and
``DecoderModel.configure``: nothing here asks which device it runs on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import fp8, layer_ops
from ..config import ModelConfig

Tensors = dict[str, list[tuple[str, tuple[int, ...]]]]


class RMSNorm(nn.Module):
    ops: layer_ops.TorchOps = layer_ops.TORCH  # the model's, set once (DecoderModel.use_ops)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


def _merge(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` concatenated along dim 0; each part's ``.data`` becomes its view into the result
    (FP8 parts concatenated as their bytes)."""
    dtype = parts[0].dtype
    as_bytes = dtype == fp8.FP8
    merged = torch.cat([p.view(torch.uint8) if as_bytes else p for p in parts])
    if as_bytes:
        merged = merged.view(dtype)
    for part, view in zip(parts, merged.split([p.shape[0] for p in parts])):
        part.data = view
    return merged



def activation(name: str):
    if name == "silu":
        return F.silu
    return lambda x: F.gelu(x, approximate="tanh")  # gelu_pytorch_tanh (config.py refuses others)


class DecoderLayer(nn.Module):
    norm_class: type[nn.Module] = RMSNorm
    scales_embeddings = False  # Gemma multiplies the embeddings by sqrt(hidden_size)
    graph_capturable = True  # False: the layer's forward reads device values on the host (no CUDA graph)
    ops: layer_ops.TorchOps = layer_ops.TORCH  # the model's, set once (DecoderModel.use_ops)
    merged = True  # EngineConfig.merged_projections (DecoderModel.configure): the merged matmuls where merged
    # q|k|v and gate|up as one matrix each (merge_projections, where the ops merge: CUDA); None: separate matmuls
    qkv_weight: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None
    gate_up_weight: torch.Tensor | None = None
    qkv_scale: torch.Tensor | None = None  # FP8 weights: the merged rows' scales (fp8.py)
    gate_up_scale: torch.Tensor | None = None
    # the parameters --quantization / an FP8 checkpoint makes FP8 (weight_source.py); the rest stay plain
    QUANTIZED_PARAMS: tuple[str, ...]
    QUANTIZED_PARAMS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                        "up_proj.weight", "down_proj.weight")

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.num_heads, cfg.head_dim
        kvh = cfg.num_kv_heads
        self.q_size, self.kv_size = h * d, kvh * d
        self.window = cfg.layer_window(index)
        self.rope_local = cfg.rope_local_theta is not None and self.window is not None
        self.act = activation(cfg.hidden_act)
        self.input_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(cfg.hidden_size, self.q_size, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_size, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.build_mlp(cfg, index)

    def build_mlp(self, cfg: ModelConfig, index: int) -> None:
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def merge_projections(self) -> None:
        """One matrix for q|k|v and one for gate|up (a dense MLP's), so a step runs one matmul where it ran
        three and two: on a GPU a decode step's small matmuls are launches and split-K reductions more
        than bytes. The separate weights become views into the merged ones (no memory added). On CPU
        the separate (oneDNN-packed) matrices measured faster, so the loader merges only where the model's
        ops say so (``layer_ops.CudaOps.merges_projections``)."""
        with torch.no_grad():
            projections = (self.q_proj, self.k_proj, self.v_proj)
            if len({p.weight.dtype for p in projections}) > 1:  # (FP8 and plain mixed: kept apart)
                return
            self.qkv_weight = _merge([p.weight for p in projections])
            if projections[0].bias is not None:
                self.qkv_bias = _merge([p.bias for p in projections])
            if projections[0].weight.dtype == fp8.FP8:
                self.qkv_scale = _merge([p.weight_scale for p in projections])
            if hasattr(self, "gate_proj") and self.gate_proj.weight.dtype == self.up_proj.weight.dtype:
                self.gate_up_weight = _merge([self.gate_proj.weight, self.up_proj.weight])
                if self.gate_proj.weight.dtype == fp8.FP8:
                    self.gate_up_scale = _merge([self.gate_proj.weight_scale, self.up_proj.weight_scale])

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head q/k norms before rotary (Qwen3, Gemma 3); none here."""
        return q, k

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        cfg, ops = self.cfg, self.ops
        h = self.input_layernorm(x)
        if self.qkv_weight is not None and self.merged:
            q, k, v = ops.matmul(h, self.qkv_weight, self.qkv_bias, self.qkv_scale).split(
                [self.q_size, self.kv_size, self.kv_size], -1)
        else:  # ops.linear: F.linear on the parameters (or their packed copy at batch), less Python than the modules
            q = ops.linear(h, self.q_proj)
            k = ops.linear(h, self.k_proj)
            v = ops.linear(h, self.v_proj)
        q, k = self.norm_qk(q.view(-1, cfg.num_heads, cfg.head_dim), k.view(-1, cfg.num_kv_heads, cfg.head_dim))
        q, k = ops.rope(q, cos, sin), ops.rope(k, cos, sin)
        return q, k, v.view(-1, cfg.num_kv_heads, cfg.head_dim)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        if self.gate_up_weight is not None and self.merged:
            gate_up = ops.matmul(h, self.gate_up_weight, None, self.gate_up_scale)
            return ops.linear(ops.act_mul(gate_up, self.act), self.down_proj)
        gate = self.act(ops.linear(h, self.gate_proj))
        return ops.linear(gate.mul_(ops.linear(h, self.up_proj)), self.down_proj)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self.ops.linear(attn, self.o_proj)
        return x + self.mlp(self.post_attention_layernorm(x))

    @classmethod
    def checkpoint_tensors(cls, cfg: ModelConfig, index: int) -> Tensors:
        h = cfg.hidden_size
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        out: Tensors = {
            "input_layernorm.weight": [("input_layernorm.weight", (h,))],
            "post_attention_layernorm.weight": [("post_attention_layernorm.weight", (h,))],
            "q_proj.weight": [("self_attn.q_proj.weight", (q, h))],
            "k_proj.weight": [("self_attn.k_proj.weight", (kv, h))],
            "v_proj.weight": [("self_attn.v_proj.weight", (kv, h))],
        }
        if cfg.attention_bias:
            for x, n in (("q", q), ("k", kv), ("v", kv)):
                out[f"{x}_proj.bias"] = [(f"self_attn.{x}_proj.bias", (n,))]
        out["o_proj.weight"] = [("self_attn.o_proj.weight", (h, q))]
        out.update(cls.mlp_tensors(cfg, index))
        return out

    @classmethod
    def mlp_tensors(cls, cfg: ModelConfig, index: int) -> Tensors:
        h, inter = cfg.hidden_size, cfg.intermediate_size
        return {
            "gate_proj.weight": [("mlp.gate_proj.weight", (inter, h))],
            "up_proj.weight": [("mlp.up_proj.weight", (inter, h))],
            "down_proj.weight": [("mlp.down_proj.weight", (h, inter))],
        }
