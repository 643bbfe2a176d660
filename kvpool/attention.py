"""DistAttention's math: micro-attention over one part of a sequence's KV, and the merge.

Attention of one query over keys split into parts P1..Pn equals the merge of each part's
micro-attention, computed where the part lives. Each part returns, per query head:

    m = max_j s_j                   (s_j = q . k_j * scale, the part's scores)
    l = sum_j exp(s_j - m)          (sum of exponentials, relative to the part's max)
    w = sum_j exp(s_j - m) * v_j    (weighted values, same reference)

and the owner merges with M = max_i m_i:  out = sum_i exp(m_i - M) w_i / sum_i exp(m_i - M) l_i.
Only the query (heads x head_dim) goes out and (2 + head_dim) x heads numbers come back per
part, whatever the part's length. Grouped-query attention: query head h reads KV head
h // (num_heads // num_kv_heads), as the engine's ``enable_gqa`` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Partial:
    """One part's micro-attention result (float32): max [H], sum_exp [H], weighted [H, D]."""

    max: torch.Tensor
    sum_exp: torch.Tensor
    weighted: torch.Tensor


def micro_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> Partial:
    """q [H, D]; k, v [N, KVH, D] (N >= 1; H a multiple of KVH) -> Partial, in float32."""
    heads, dim = q.shape
    n, kv_heads, _ = k.shape
    if n < 1:
        raise ValueError("micro_attention needs at least one key")
    if heads % kv_heads:
        raise ValueError(f"query heads {heads} are not a multiple of KV heads {kv_heads}")
    scale = dim ** -0.5 if scale is None else scale
    group = heads // kv_heads
    qg = q.float().view(kv_heads, group, dim)                      # [KVH, G, D]
    scores = torch.einsum("hgd,nhd->hgn", qg, k.float()) * scale   # [KVH, G, N]
    m = scores.amax(dim=-1)                                        # [KVH, G]
    p = torch.exp(scores - m.unsqueeze(-1))
    w = torch.einsum("hgn,nhd->hgd", p, v.float())                 # [KVH, G, D]
    return Partial(m.reshape(heads), p.sum(dim=-1).reshape(heads), w.reshape(heads, dim))


def merge(parts: list[Partial]) -> torch.Tensor:
    """The attention output [H, D] over the union of the parts' keys."""
    if not parts:
        raise ValueError("merge needs at least one partial result")
    m = torch.stack([p.max for p in parts])                # [P, H]
    top = m.amax(dim=0)                                    # [H]
    alpha = torch.exp(m - top)                             # [P, H]
    total = (alpha * torch.stack([p.sum_exp for p in parts])).sum(dim=0)
    out = (alpha.unsqueeze(-1) * torch.stack([p.weighted for p in parts])).sum(dim=0)
    return out / total.unsqueeze(-1)


def to_bytes(part: Partial) -> tuple[bytes, bytes, bytes]:
    return tuple(t.float().contiguous().numpy().tobytes() for t in (part.max, part.sum_exp, part.weighted))


def from_bytes(m: bytes, s: bytes, w: bytes, heads: int) -> Partial:
    def tensor(raw: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(raw), dtype=torch.float32)

    return Partial(tensor(m), tensor(s), tensor(w).view(heads, -1))
