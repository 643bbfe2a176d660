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


# torch's CPU flash-attention kernel as an op that also returns each query's log-sum-exp (torch is pinned in
# pyproject.toml; without the op, prefix_attend falls back to the masked SDPA)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
PAD_SHORT_PREFIX = 8  # prefix_attend pads instead of merging when the new tokens are at least 8x the cached ones


def prefix_attend(q, k, v, n_cached: int, scale=None) -> torch.Tensor:
    """A prefill after a prefix-cache hit, on CPU: q [1, H, Lq, D] (the new tokens), k/v [1, KVH, n_cached + Lq, D]
    (context then new) -> [1, H, Lq, D], each new token seeing the whole context and the new tokens up to itself.

    The masked SDPA this replaces computes every (query, key) pair, the upper triangle of the new part
    included. Here torch's flash kernel runs twice: the new queries over the cached keys
    (no mask) and over the new keys (causal, the triangle skipped); the two outputs are merged by their
    log-sum-exps (float32). Time per call measured 0.41-0.72x of the masked call's in float32 and 0.50-0.81x
    in bfloat16 (1,024-3,840 new tokens after 256-2,048 cached, 4 / 2 heads of 64, one thread, Intel Xeon;
    the more new tokens, the more the triangle saves): bench/engine/prefix_attention.py."""
    if _FLASH_CPU is None or q.device.type != "cpu" or n_cached == 0:
        mask = causal_mask(q.shape[-2], k.shape[-2], None, q.device)
        return attend(q, k, v, mask=mask, scale=scale)
    if n_cached * PAD_SHORT_PREFIX <= q.shape[-2]:
        # A short cached prefix (a shared first block): one causal call over the whole context, with zero query
        # rows standing in for the cached positions. Their n_cached^2 / 2 extra pairs cost less than the second
        # call and the merge: 89.6 against 103.4 ms at 64 cached and 3,900 new tokens, equal at 512 : 3,452
        # (float32, the small checkpoint's heads, one thread, Intel Xeon, beside a CI run).
        pad = q.new_zeros(q.shape[0], q.shape[1], n_cached, q.shape[3])
        return _FLASH_CPU(torch.cat([pad, q], dim=2), k, v, 0.0, True, scale=scale)[0][:, :, n_cached:]
    o1, l1 = _FLASH_CPU(q, k[:, :, :n_cached], v[:, :, :n_cached], 0.0, False, scale=scale)
    o2, l2 = _FLASH_CPU(q, k[:, :, n_cached:], v[:, :, n_cached:], 0.0, True, scale=scale)
    top = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - top).unsqueeze(-1), torch.exp(l2 - top).unsqueeze(-1)
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).to(q.dtype)


def decode_attend(q, k, v, bias, scale=None) -> torch.Tensor:
    """One new token per sequence over its gathered context, on CPU: q [B, H, D], k/v
    [B, L, KVH, D] (as ``KVCache.gather`` returns them), ``bias`` [B, 1, L] float (0 where the
    slot is in the context, -inf elsewhere: ``mask_bias``) -> [B, H, D].

    The H / KVH query heads sharing a KV head form one matrix, so each K/V row is read once per
    KV head (CPU SDPA reads it once per query head) and straight from the gathered layout (a
    strided view per KV head; no transpose copy): measured 0.53-0.87x of SDPA's time (B 1-16,
    L 576-2112, 16 / 2 heads, one thread)."""
    b, h, d = q.shape
    kvh = k.shape[2]
    qg = q.view(b, kvh, h // kvh, d)
    out = torch.empty(b, kvh, h // kvh, d, dtype=q.dtype, device=q.device)
    alpha = scale if scale is not None else d**-0.5
    for g in range(kvh):
        scores = torch.baddbmm(bias, qg[:, g], k[:, :, g].transpose(1, 2), alpha=alpha)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        out[:, g] = torch.bmm(probs, v[:, :, g])
    return out.view(b, h, d)


def mask_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool decode mask [B, 1, 1, L] (True = attend) as the additive bias ``decode_attend`` takes."""
    bias = torch.zeros(mask.shape[0], 1, mask.shape[-1], dtype=dtype, device=mask.device)
    return bias.masked_fill_(~mask.view(bias.shape), float("-inf"))


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
