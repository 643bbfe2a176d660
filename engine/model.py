"""DecoderModel: a decoder (any family of ``engine/models/``) that reads and writes a paged KV cache.

One forward call runs a *mixed batch*: some sequences in prefill (several new tokens each),
the rest in decode (one new token each). All new tokens are flattened into one ``[T, hidden]``
tensor so every linear layer is one matmul for the whole batch. Attention is per prefill
sequence (usually few), and one batched call for all decode sequences over a single padded
gather of their block tables (built once per step in ``ForwardBatch``, reused by every layer).

Layer-by-layer: ``forward(batch, kv, on_layer=cb)`` calls ``cb(layer_idx)`` right after that
layer's K/V are written into the cache (the CacheStore sends that layer while the next ones
compute). On a GPU the writes are only queued by then: ``kv.mark_written`` records a CUDA event
that the CacheStore's thread waits on before it reads (``KVCache.written_waiter``), so the
engine's stream never stops for a layer. Without ``on_layer`` it is the same code, so both give
identical results.

The family's layer (``models.layer_class``) does the per-token work; this module does what is
shared: embeddings (scaled for Gemma), rotary tables (two for Gemma 3), attention over the
cache (by the backend the batch names, ``attention_backends.py``; the math in ``attention.py``:
scale, soft-capping, sliding-window masks per layer), the LM head (final soft-capping).

The ops between the matmuls and the linear layers themselves are the model's ``ops`` (``layer_ops.py``),
chosen once by device and the engine's switches (``use_ops``, by the loader and ``configure``) and held by
every layer and norm: the forward code has no device branch. Projections are kept as separate matrices like
the checkpoint's on CPU (one merged q|k|v or gate|up matrix measured slower there: its GEMMs pack a larger
right-hand side per call); on CUDA the loader merges them (``ops.merges_projections``;
``DecoderLayer.merge_projections``: one matmul instead of three and two, 1.07-1.13x a decode step of the
8B shape on an H200).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from . import layer_ops
from .attention import attend, causal_mask
from .attention_backends import backend
from .config import ModelConfig, rope_inv_freq
from .kv_cache import KVCache
from .models import layer_class


@dataclass
class PrefillSpan:
    """One prefill sequence in a ForwardBatch: its new tokens are rows [start, end)."""

    start: int
    end: int
    num_cached: int  # tokens whose KV is already in the cache (prefix hit); 0 -> no gather needed
    context_rows: torch.Tensor | None  # K rows of all num_cached + new tokens, when num_cached > 0
    samples: bool = True  # its last row is a logits row (the prompt's last chunk); False: a chunk before it


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
    decode_tables: torch.Tensor | None = None  # [B, max_blocks] long: each decode sequence's block table (padded)
    decode_ends: torch.Tensor | None = None  # [B] long: tokens in each decode sequence's context
    # "triton": attention by the paged kernels of gpu_attention.py (CUDA; the CPU tests use Triton's
    # interpreter), which also need the prefill spans' block tables and lengths below; "native": attention.py
    # with decode rows by the C++ kernel (native.py) where it applies; "torch": attention.py
    attention: str = "torch"
    prefill_tables: torch.Tensor | None = None  # [S, max_blocks] long: each prefill span's block table (padded)
    prefill_ctx_lens: list[int] | None = None  # tokens in each prefill span's context (cached + new)


@functools.lru_cache(maxsize=None)
def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (what ``torch.tensor(value, dtype=dtype)`` holds), as a Python float."""
    return torch.tensor(value, dtype=dtype).item()


class DecoderModel(nn.Module):
    """The decoder plus LM head. Parameters are created empty; ``loader.py`` fills them."""

    ops: layer_ops.TorchOps = layer_ops.TORCH  # chosen once (use_ops): the loader, then configure

    def __init__(self, cfg: ModelConfig, vocab_rows: int | None = None):
        """``vocab_rows``: the LM head's rows when a tensor-parallel rank holds only its part of the
        vocabulary (``tp/shard.py``); None: the whole vocabulary."""
        super().__init__()
        self.cfg = cfg
        layer_cls = layer_class(cfg)
        self.embed_scale = cfg.hidden_size**0.5 if layer_cls.scales_embeddings else None
        self.attn_scale = cfg.query_pre_attn_scalar**-0.5 if cfg.query_pre_attn_scalar else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_cls(cfg, i) for i in range(cfg.num_layers))
        self.rope_kinds = tuple({layer.rope_local for layer in self.layers})  # local (Gemma 3) and/or global
        self.norm = layer_cls.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab_rows or cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings and self.lm_head.out_features == cfg.vocab_size:
            self.lm_head.weight = self.embed_tokens.weight
        for name in ("rope_cos", "rope_sin", "rope_cos_local", "rope_sin_local"):
            self.register_buffer(name, torch.empty(0), persistent=False)
        self.init_rope()

    def use_ops(self, ops: layer_ops.TorchOps, packed_linear: bool = True) -> None:
        """``ops`` for the model, every layer and norm (``layer_ops.choose``'s), and the weights made ready for
        them (``ops.prepare``: the CPU's packed linear copies made, or dropped when ``packed_linear`` is off)."""
        for module in self.modules():
            if isinstance(getattr(type(module), "ops", None), layer_ops.TorchOps):
                module.ops = ops
        ops.prepare(self, packed_linear)

    def configure(self, *, fused_elementwise: bool = True, merged_projections: bool = True,
                  packed_linear: bool = True) -> None:
        """The engine switches the model reads (EngineConfig's, set once by the engine): the fused CUDA
        elementwise kernels (norms, rotary, silu*mul: ``layer_ops.choose`` picks the ops again), the merged
        q|k|v and gate|up matmuls (where the loader merged them), and the CPU's packed linear weights (dropped
        when off, packed again when back on)."""
        self.use_ops(layer_ops.choose(self.embed_tokens.weight.device, fused_elementwise), packed_linear)
        for module in self.modules():
            if hasattr(module, "merged"):
                module.merged = merged_projections

    def init_rope(self) -> None:
        """(Re)compute the rotary cos/sin tables (float32) on the model's device."""
        device = self.embed_tokens.weight.device
        if device.type == "meta":
            return
        pos = torch.arange(self.cfg.max_position_embeddings, dtype=torch.float32, device=device)
        for local in (False, True) if self.cfg.rope_local_theta is not None else (False,):
            freqs = torch.outer(pos, rope_inv_freq(self.cfg, local=local).to(device))
            emb = torch.cat((freqs, freqs), dim=-1)
            suffix = "_local" if local else ""
            setattr(self, "rope_cos" + suffix, emb.cos())
            setattr(self, "rope_sin" + suffix, emb.sin())

    def rope(self, positions: torch.Tensor, dtype: torch.dtype, local: bool = False):
        """(cos, sin) of the rotary embedding at ``positions``, shaped to broadcast over heads: the
        public hook for code that runs the layers itself (``kvpool/pooled.py``)."""
        cos_t, sin_t = (self.rope_cos_local, self.rope_sin_local) if local else (self.rope_cos, self.rope_sin)
        cos = cos_t.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = sin_t.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:  # the scale rounded to the weights' dtype, as transformers does
            x = x * _rounded(self.embed_scale, x.dtype)  # a Python number: no host->device copy (CUDA graphs)
        return x

    def _ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[bool, tuple]:
        """{local?: (cos, sin)} for the tables the layers use."""
        return {local: self.rope(positions, dtype, local) for local in self.rope_kinds}

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.ops.linear(x, self.lm_head)
        cap = self.cfg.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache, on_layer: Callable[[int], None] | None = None,
                extra_rows=(), on_rows: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
        """Logits ``[num_seqs, vocab]`` of each sequence's last new token; writes new tokens' K/V. Then the
        logits of each tensor of row indices in ``extra_rows`` (prompt logprobs), handed to ``on_rows(i,
        logits)`` one tensor at a time. Every tensor-parallel rank runs exactly this (the same collectives in
        the same order: ``tp/``)."""
        x = self._embed(batch.input_ids)
        layers = range(len(self.layers))
        if extra_rows or batch.logits_rows.shape[0] >= x.shape[0]:  # every row's last hidden state is read
            x = self.run_layers(x, batch, kv, layers, on_layer)
            logits = self.head(x, batch)
        else:  # a prefill: only its sampled rows leave the last layer (``run_layers``' out_rows)
            x = self.run_layers(x, batch, kv, layers, on_layer, out_rows=batch.logits_rows)
            logits = self._logits(self.norm(x))
        for i, rows in enumerate(extra_rows):
            part = self.logits_at(x, rows)
            if on_rows is not None:
                on_rows(i, part)
        return logits

    def run_layers(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv: KVCache,
        layer_ids: range,
        on_layer: Callable[[int], None] | None = None,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` through layers ``layer_ids`` (a pipeline stage runs its
        own range); layer ``i``'s K/V go to ``kv`` layer ``i - layer_ids.start``.

        ``out_rows``: only these rows' states are wanted from the last layer (a step's sampled rows, in
        ``logits_rows``' order), which then returns ``[len(out_rows), hidden]``: its K/V are written for every
        row as always, but its attention (where the backend has ``attend_rows``), output projection and MLP
        (each row's own: the same values) run for those rows alone. A 2,048-token prefill of 8 layers skips
        about an eighth of its linear layers' and its attention's work."""
        cfg = self.cfg
        ropes = self._ropes(batch.positions, x.dtype)
        masks: dict = {}  # sliding-window masks, built once per step and window
        for i in layer_ids:
            layer, c = self.layers[i], i - layer_ids.start
            q, k, v = layer.qkv(x, *ropes[layer.rope_local])
            k, v = kv.write(c, batch.slot_rows, k, v)  # fp8: as the cache holds them (dequantized)
            if on_layer is not None:
                kv.mark_written(c)  # a CUDA event the CacheStore's thread waits on; no stream sync here
                on_layer(i)
            if out_rows is not None and i == layer_ids[-1]:
                if out_rows.shape[0] == 0:  # a chunk before a prompt's last: nothing leaves this step
                    return x[:0]
                x, attn = self._rows_attention(c, layer.window, q, k, v, batch, kv, masks, x, out_rows)
            else:
                attn = self._paged_attention(c, layer.window, q, k, v, batch, kv, masks)
            x = layer.finish(x, attn.view(x.shape[0], cfg.num_heads * cfg.head_dim))
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first stage's input: token embeddings (scaled where the family asks)."""
        return self._embed(input_ids)

    def head(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[num_seqs, vocab]`` (float32) of each sequence's last row of ``x``."""
        return self.logits_at(x, batch.logits_rows)

    def logits_at(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Logits ``[len(rows), vocab]`` (float32) of these rows of the last layer's hidden states ``x``."""
        return self._logits(self.norm(x.index_select(0, rows)))

    def _paged_attention(self, i, window, q, k, v, batch: ForwardBatch, kv: KVCache, masks: dict) -> torch.Tensor:
        """Layer i's attention output ``[T, H, D]`` for every new token of the batch, by the batch's backend
        (``attention_backends.py``: chosen once per engine by the runner)."""
        return backend(batch.attention).attend(i, window, q, k, v, batch, kv, masks, self.attn_scale,
                                               self.cfg.attn_logit_softcapping)

    def _rows_attention(self, i, window, q, k, v, batch: ForwardBatch, kv: KVCache, masks: dict, x: torch.Tensor,
                        rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``x``'s rows ``rows``, layer i's attention output for them alone): by the backend's ``attend_rows``
        where it has one (the sampled rows: ``rows`` is ``batch.logits_rows``), else every row's, then selected."""
        b = backend(batch.attention)
        if hasattr(b, "attend_rows") and rows is batch.logits_rows:
            out = b.attend_rows(i, window, q, k, v, batch, kv, masks, self.attn_scale, self.cfg.attn_logit_softcapping)
            return x.index_select(0, rows), out
        out = self._paged_attention(i, window, q, k, v, batch, kv, masks)
        return x.index_select(0, rows), out.index_select(0, rows)

    @torch.inference_mode()
    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Reference forward over one whole sequence without any cache: logits ``[L, vocab]``."""
        x = self._embed(input_ids)
        n = input_ids.shape[0]
        ropes = self._ropes(torch.arange(n, device=input_ids.device), x.dtype)
        for layer in self.layers:
            q, k, v = layer.qkv(x, *ropes[layer.rope_local])
            mask = None if layer.window is None else causal_mask(n, n, layer.window, x.device)
            o = attend(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                       mask=mask, causal=mask is None, scale=self.attn_scale, softcap=self.cfg.attn_logit_softcapping)
            x = layer.finish(x, o.squeeze(0).transpose(0, 1).reshape(n, -1))
        return self._logits(self.norm(x))
