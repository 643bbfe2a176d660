"""DecoderModel: a Llama/Qwen2-family decoder that reads and writes a paged KV cache.

One forward call runs a *mixed batch*: some sequences in prefill (several new tokens each),
the rest in decode (one new token each). All new tokens are flattened into one ``[T, hidden]``
tensor so every linear layer is one matmul for the whole batch. Attention is per prefill
sequence (usually few), and one batched call for all decode sequences over a single padded
gather of their block tables (built once per step in ``ForwardBatch``, reused by every layer).

Layer-by-layer: ``forward(batch, kv, on_layer=cb)`` calls ``cb(layer_idx)`` right after that
layer's K/V are written into the cache (the CacheStore sends that layer while the next ones
compute). Without ``on_layer`` it is the same code, so both give identical results.

Projections are kept as separate matrices like the checkpoint's (on CPU, one merged q|k|v or
gate|up matrix measured slower: its GEMMs pack a larger right-hand side per call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, rope_inv_freq
from .kv_cache import KVCache


@dataclass
class PrefillSpan:
    """One prefill sequence in a ForwardBatch: its new tokens are rows [start, end)."""

    start: int
    end: int
    num_cached: int  # tokens whose KV is already in the cache (prefix hit); 0 -> no gather needed
    context_rows: torch.Tensor | None  # K rows of all num_cached + new tokens, when num_cached > 0


@dataclass
class ForwardBatch:
    """Everything a forward pass needs besides the weights; built once per engine step.

    Rows: prefill sequences' new tokens first (``prefills``), then one row per decode sequence
    starting at ``decode_start``. ``logits_rows`` picks each sequence's last row (the rows
    whose logits are sampled), in the same order (prefills, then decodes).
    """

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_rows: torch.Tensor  # [T] K rows where each new token's K/V is written
    prefills: list[PrefillSpan]
    decode_start: int
    decode_rows: torch.Tensor | None  # [B, L] K rows of each decode sequence's context (padded)
    decode_mask: torch.Tensor | None  # [B, 1, 1, L] bool, True where the slot is in the context
    logits_rows: torch.Tensor  # [num_seqs] long


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # one fused kernel, same result as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, 1, D] (the half-split convention of Llama checkpoints)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.num_heads, cfg.head_dim
        kvh = cfg.num_kv_heads
        self.q_size, self.kv_size = h * d, kvh * d
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(cfg.hidden_size, self.q_size, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_size, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        cfg = self.cfg
        h = self.input_layernorm(x)
        # F.linear on the parameters: the same math as calling the modules, less Python per call
        q = F.linear(h, self.q_proj.weight, self.q_proj.bias)
        k = F.linear(h, self.k_proj.weight, self.k_proj.bias)
        v = F.linear(h, self.v_proj.weight, self.v_proj.bias)
        q = apply_rope(q.view(-1, cfg.num_heads, cfg.head_dim), cos, sin)
        k = apply_rope(k.view(-1, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        return q, k, v.view(-1, cfg.num_kv_heads, cfg.head_dim)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + F.linear(attn, self.o_proj.weight)
        h = self.post_attention_layernorm(x)
        gate = F.silu(F.linear(h, self.gate_proj.weight))
        return x + F.linear(gate.mul_(F.linear(h, self.up_proj.weight)), self.down_proj.weight)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, causal=False) -> torch.Tensor:
    """q [B, H, Lq, D], k/v [B, KVH, Lk, D] -> [B, H, Lq, D] (grouped-query attention)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)


class DecoderModel(nn.Module):
    """The decoder plus LM head. Parameters are created empty; ``loader.py`` fills them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.init_rope()

    def init_rope(self) -> None:
        """(Re)compute the rotary cos/sin tables (float32) on the model's device."""
        device = self.embed_tokens.weight.device
        if device.type == "meta":
            return
        inv = rope_inv_freq(self.cfg).to(device)
        pos = torch.arange(self.cfg.max_position_embeddings, dtype=torch.float32, device=device)
        freqs = torch.outer(pos, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rope_cos = emb.cos()
        self.rope_sin = emb.sin()

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        cos = self.rope_cos.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.rope_sin.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        kv: KVCache,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Logits ``[num_seqs, vocab]`` of each sequence's last new token; writes new tokens' K/V."""
        x = self.embed_tokens(batch.input_ids)
        x = self.run_layers(x, batch, kv, range(len(self.layers)), on_layer)
        return self.head(x, batch)

    def run_layers(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv: KVCache,
        layer_ids: range,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` through layers ``layer_ids`` (a pipeline stage runs its
        own range); layer ``i``'s K/V go to ``kv`` layer ``i - layer_ids.start``."""
        cfg = self.cfg
        cos, sin = self._rope(batch.positions, x.dtype)
        sync = on_layer is not None and kv.device.type == "cuda"
        for i in layer_ids:
            layer, c = self.layers[i], i - layer_ids.start
            q, k, v = layer.qkv(x, cos, sin)
            kv.write(c, batch.slot_rows, k, v)
            if on_layer is not None:
                if sync:
                    torch.cuda.current_stream(kv.device).synchronize()
                on_layer(i)
            out = torch.empty_like(q)
            for span in batch.prefills:
                qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0)
                if span.num_cached == 0:
                    ks = k[span.start : span.end].transpose(0, 1).unsqueeze(0)
                    vs = v[span.start : span.end].transpose(0, 1).unsqueeze(0)
                    o = _attend(qs, ks, vs, causal=True)
                else:
                    kc, vc = kv.gather(c, span.context_rows)
                    n_new = span.end - span.start
                    n_ctx = span.num_cached + n_new
                    mask = torch.ones(n_new, n_ctx, dtype=torch.bool, device=x.device).tril(diagonal=span.num_cached)
                    o = _attend(qs, kc.to(q.dtype).transpose(0, 1).unsqueeze(0), vc.to(q.dtype).transpose(0, 1).unsqueeze(0), mask=mask)
                out[span.start : span.end] = o.squeeze(0).transpose(0, 1)
            if batch.decode_rows is not None:
                kc, vc = kv.gather(c, batch.decode_rows)  # [B, L, KVH, D]
                qd = q[batch.decode_start :].unsqueeze(2)  # [B, H, 1, D]
                o = _attend(qd, kc.to(q.dtype).transpose(1, 2), vc.to(q.dtype).transpose(1, 2), mask=batch.decode_mask)
                out[batch.decode_start :] = o.squeeze(2)
            x = layer.finish(x, out.view(x.shape[0], cfg.num_heads * cfg.head_dim))
        return x

    def head(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[num_seqs, vocab]`` (float32) of each sequence's last row of ``x``."""
        x = self.norm(x.index_select(0, batch.logits_rows))
        return self.lm_head(x).float()

    @torch.inference_mode()
    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Reference forward over one whole sequence without any cache: logits ``[L, vocab]``."""
        x = self.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        cos, sin = self._rope(positions, x.dtype)
        for layer in self.layers:
            q, k, v = layer.qkv(x, cos, sin)
            o = _attend(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), causal=True)
            x = layer.finish(x, o.squeeze(0).transpose(0, 1).reshape(x.shape[0], -1))
        return self.lm_head(self.norm(x)).float()
