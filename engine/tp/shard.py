"""Shard: what one tensor-parallel rank holds of a model, and the checkpoint slices that make it.

A rank runs a model of the same family with 1/N of the attention heads and of the MLP's width:
``Shard.config`` is that model's ModelConfig, so the family's layer code runs unchanged on it.
What differs is where partial results are combined (``group.py`` hooks them on the projections).

Per layer, rank r of N holds (H heads, KVH KV heads, I the MLP's intermediate size):

- q_proj (and its bias): the rows of query heads ``[r*H/N, (r+1)*H/N)``: column-parallel;
- k_proj, v_proj: the rows of its KV heads: ``[r*KVH/N, (r+1)*KVH/N)`` when N divides KVH; with fewer
  KV heads than ranks (N a multiple of KVH), the one KV head its query heads read, ``r // (N/KVH)``
  (replicated on N/KVH ranks); its KV cache holds only these heads;
- o_proj: the columns of its query heads: row-parallel, the ranks' outputs summed (all-reduce);
- gate_proj, up_proj: rows ``[r*I/N, (r+1)*I/N)``; down_proj: those columns (all-reduce);
- lm_head: vocabulary rows ``[r*V', (r+1)*V')``, V' = ceil(V/N) (the last rank's padded with zero
  rows); the ranks' logits are gathered and cut back to V columns;
- everything else whole: the norms, q/k norms, and the token embedding. The embedding is
  replicated rather than vocab-parallel: a lookup reads T rows and computes nothing, while a
  vocab-parallel one would add an all-reduce of [T, hidden] to every step (8 MiB for a 2k-token
  prefill at hidden 1024) to save V x hidden bytes per rank. A tied LM head takes its rows from it.

MoE layers (qwen3_moe): every expert is split as a dense MLP is, by its own width (gate/up rows, down
columns of ``moe_intermediate_size / N``), and the router is whole: each rank routes every token the same
way and runs every chosen expert on its slice; the layer's output is summed across ranks (one all-reduce,
as a dense MLP's). Tensor parallelism inside the experts rather than expert parallelism: it needs no
token exchange and keeps each rank's work the same whatever the router picks (expert parallelism would
balance only on average, and a rank would wait on the busiest one every layer).

FP8 checkpoints: a ``*.weight_scale`` with one entry per output row is sliced with its weight's rows;
others (per tensor, or a column-sliced weight's rows) stay whole. ``Shard(0, 1, cfg)`` is the whole model
(TP 1).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..config import ModelConfig
from .heads import kv_head_ranges, pairing_error  # noqa: F401 - re-exported (torch-free home)

# checkpoint-name suffix -> (dim sliced, what is sliced): "q" query heads, "kv" KV heads, "mlp" the MLP's rows
_SLICES = {
    "self_attn.q_proj.weight": (0, "q"), "self_attn.q_proj.bias": (0, "q"),
    "self_attn.k_proj.weight": (0, "kv"), "self_attn.k_proj.bias": (0, "kv"),
    "self_attn.v_proj.weight": (0, "kv"), "self_attn.v_proj.bias": (0, "kv"),
    "self_attn.o_proj.weight": (1, "q"),
    "mlp.gate_proj.weight": (0, "mlp"), "mlp.up_proj.weight": (0, "mlp"), "mlp.down_proj.weight": (1, "mlp"),
}
# a MoE layer's experts ("mlp.experts.<e>.<suffix>"): each expert's MLP split as a dense one, by its own width
_EXPERT_SLICES = {"gate_proj.weight": (0, "moe"), "up_proj.weight": (0, "moe"), "down_proj.weight": (1, "moe")}


class ShardError(ValueError):
    """A tensor-parallel size this model cannot be split into (the message names both)."""


@dataclass(frozen=True, slots=True)
class Shard:
    rank: int
    size: int
    full: ModelConfig  # the checkpoint's shape

    def __post_init__(self) -> None:
        check_splittable(self.full, self.size)
        if not 0 <= self.rank < self.size:
            raise ShardError(f"tensor-parallel rank {self.rank} is outside 0..{self.size - 1}")

    @property
    def config(self) -> ModelConfig:
        """The model this rank runs: its heads, KV heads and MLP width (the rest as the checkpoint's)."""
        cfg = self.full
        return replace(cfg, num_heads=cfg.num_heads // self.size, num_kv_heads=len(self.kv_heads),
                       head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size // self.size,
                       moe_intermediate_size=cfg.moe_intermediate_size // self.size)

    @property
    def kv_heads(self) -> range:
        """The KV heads this rank holds (and caches)."""
        return kv_head_ranges(self.full.num_kv_heads, self.size)[self.rank]

    @property
    def vocab_rows(self) -> int:
        """Rows of this rank's LM head: ceil(V / N) (the last rank's end in zero rows)."""
        return -(-self.full.vocab_size // self.size)

    def _range(self, kind: str) -> range:
        d = self.full.head_dim
        if kind == "q":
            per = self.full.num_heads // self.size * d
            return range(self.rank * per, (self.rank + 1) * per)
        if kind == "kv":
            return range(self.kv_heads.start * d, self.kv_heads.stop * d)
        if kind in ("mlp", "moe"):
            per = (self.full.intermediate_size if kind == "mlp" else self.full.moe_intermediate_size) // self.size
            return range(self.rank * per, (self.rank + 1) * per)
        rows = self.vocab_rows  # "vocab"
        return range(self.rank * rows, min((self.rank + 1) * rows, self.full.vocab_size))

    def rule(self, hf_name: str) -> tuple[int, range] | None:
        """(dim, indices) of the checkpoint tensor ``hf_name`` this rank takes; None: the whole tensor."""
        if hf_name == "lm_head.weight":
            return 0, self._range("vocab")
        slices = _EXPERT_SLICES if ".mlp.experts." in hf_name else _SLICES
        for suffix, (dim, kind) in slices.items():
            if hf_name.endswith(suffix):
                return dim, self._range(kind)
        return None

    def take(self, hf_name: str, tensor, full_shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's part of ``tensor`` (a torch tensor or a safetensors slice, whose whole shape is
        ``full_shape``): the rows or columns ``rule`` names, a row-wise FP8 scale with its weight's rows."""
        rule = self.rule(hf_name.removesuffix("_scale"))
        if hf_name.endswith("_scale") and (rule is None or rule[0] != 0 or not full_shape
                                           or full_shape[0] != self._whole(hf_name.removesuffix("_scale"))):
            rule = None
        if rule is None or self.size == 1:
            return tensor[:]
        dim, idx = rule
        part = tensor[idx.start : idx.stop] if dim == 0 else tensor[:, idx.start : idx.stop]
        if hf_name == "lm_head.weight" and len(idx) < self.vocab_rows:
            part = torch.nn.functional.pad(part, (0, 0, 0, self.vocab_rows - len(idx)))
        return part

    def _whole(self, hf_name: str) -> int:
        """Rows of the whole weight ``hf_name`` along the dim its rule slices (for its scale's length)."""
        slices = _EXPERT_SLICES if ".mlp.experts." in hf_name else _SLICES
        _, kind = next((v for s, v in slices.items() if hf_name.endswith(s)), (0, "vocab"))
        cfg = self.full
        return {"q": cfg.num_heads * cfg.head_dim, "kv": cfg.num_kv_heads * cfg.head_dim, "mlp": cfg.intermediate_size,
                "moe": cfg.moe_intermediate_size, "vocab": cfg.vocab_size}[kind]

    def tied_head(self, embedding: torch.nn.Parameter) -> torch.nn.Parameter:
        """The LM head of a model whose head is its embedding: the embedding itself, or this rank's rows."""
        if self.size == 1:
            return embedding
        return torch.nn.Parameter(self.take("lm_head.weight", embedding.data, tuple(embedding.shape)),
                                  requires_grad=False)

    def shape(self, hf_name: str, full_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of this rank's part of a tensor whose whole shape is ``full_shape``."""
        rule = None if self.size == 1 else self.rule(hf_name)
        if rule is None:
            return full_shape
        dim, idx = rule
        n = self.vocab_rows if hf_name == "lm_head.weight" else len(idx)
        return tuple(n if i == dim else s for i, s in enumerate(full_shape))


def check_splittable(cfg: ModelConfig, size: int) -> None:
    """ShardError naming the problem when ``cfg`` cannot run on ``size`` tensor-parallel ranks."""
    if size < 1:
        raise ShardError(f"tensor-parallel size must be >= 1, got {size}")
    if size == 1:
        return
    if cfg.num_experts and cfg.moe_intermediate_size % size:
        raise ShardError(f"tensor-parallel size {size} does not divide the model's expert MLP size "
                         f"{cfg.moe_intermediate_size}")
    if cfg.num_heads % size:
        raise ShardError(f"tensor-parallel size {size} does not divide the model's {cfg.num_heads} attention heads")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        raise ShardError(f"tensor-parallel size {size} and the model's {cfg.num_kv_heads} KV heads: one must "
                         "divide the other (KV heads are split across ranks, or replicated when fewer)")
    if cfg.intermediate_size % size:
        raise ShardError(f"tensor-parallel size {size} does not divide the model's MLP intermediate size "
                         f"{cfg.intermediate_size}")
