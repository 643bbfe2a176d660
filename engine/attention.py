"""Attention math for DecoderModel: grouped-query attention with an optional scale, tanh
soft-capping (Gemma 2) and sliding-window masks.

Sliding windows are masks over the paged context: a query at position p sees keys at
positions ``p - window < j <= p`` (transformers' convention: the window counts the query's own
position). Out-of-window blocks stay allocated; only the mask changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(q, k, v, mask=None, causal=False, scale=None, softcap=None) -> torch.Tensor:
    """q [B, H, Lq, D], k/v [B, KVH, Lk, D] -> [B, H, Lq, D]. ``mask`` bool, True = attend."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = causal_mask(q.shape[-2], k.shape[-2], None, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def causal_mask(n_new: int, n_ctx: int, window: int | None, device) -> torch.Tensor:
    """[n_new, n_ctx] bool: the last n_new of n_ctx positions, each seeing itself, the past and
    (with ``window``) only the last ``window`` positions."""
    qpos = torch.arange(n_ctx - n_new, n_ctx, device=device).unsqueeze(1)
    kpos = torch.arange(n_ctx, device=device)
    mask = kpos <= qpos
    if window is not None:
        mask &= qpos - kpos < window
    return mask


def decode_window_mask(decode_mask: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """``decode_mask`` [B, 1, 1, L] narrowed to each row's window; ``positions`` [B] of the new tokens."""
    kpos = torch.arange(decode_mask.shape[-1], device=decode_mask.device)
    inside = kpos.unsqueeze(0) > (positions.unsqueeze(1) - window)
    return decode_mask & inside.view(decode_mask.shape)
