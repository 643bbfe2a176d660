"""Attention backends: how a layer's attention over the paged KV cache runs, one object per kind, chosen
once per engine (``choose``, by the runner) and named in every ForwardBatch (``batch.attention``).

``backend(name).attend(i, window, q, k, v, batch, kv, masks, scale, softcap) -> [T, H, D]``: layer ``i``'s
attention for every new token of the batch (prefill spans first, then decode rows; ``model.py``'s
ForwardBatch). ``scale`` None means head_dim ** -0.5; ``softcap`` None means none; ``window`` None means
full attention; ``masks`` caches what a step builds once per window (masks, start positions).
``reads_tables``: the backend reads the block tables in place (the runner then builds the tables, not
gathered context rows).

- ``torch`` (``attention.py``): prefill spans by SDPA / torch's CPU flash kernel (``prefix_attend`` after
  a prefix hit; a masked SDPA with a sliding window or soft-capping), decode rows by one ``decode_attend``
  over the gathered context (CPU) or a masked SDPA; every device, the reference.
- ``native``: ``torch``, with the decode rows by the C++ kernel over the cache in place (``native.py``) where
  it applies (CPU, float32/bfloat16 or an fp8 cache, a compiled head size, no soft-capping).
- ``triton``: the paged kernels of ``gpu_attention.py`` (CUDA), one varlen prefill launch, one
  flash-decoding launch.

A new backend (FlashInfer on CUDA) is a class here and a row in ``BACKENDS``; the model code does not change.
"""

from __future__ import annotations

import logging

import torch

from . import gpu_attention, native
from .attention import attend, causal_mask, decode_attend, decode_window_mask, mask_bias, prefix_attend

log = logging.getLogger(__name__)


class TorchAttention:
    name = "torch"
    reads_tables = False

    def attend(self, i, window, q, k, v, batch, kv, masks: dict, scale, softcap) -> torch.Tensor:
        out = torch.empty_like(q)
        for s, span in enumerate(batch.prefills):
            out[span.start : span.end] = self._prefill_span(s, span, i, window, q, k, v, kv, masks, scale, softcap)
        if batch.decode_tables is not None:
            n = batch.decode_start
            out[n:] = self._decode(i, window, q[n:], batch, kv, masks, scale, softcap)
        return out

    def attend_rows(self, i, window, q, k, v, batch, kv, masks: dict, scale, softcap) -> torch.Tensor:
        """``attend`` for the batch's sampled rows alone (``logits_rows``: the last row of each span that ends
        its prompt, then every decode row) -> [len(logits_rows), H, D]. A span's last token sees its whole
        context (within ``window``: its last ``window`` keys), so its row is one query over those keys, no mask."""
        parts = [self._last_row(span, i, window, q, k, v, kv, scale, softcap) for span in batch.prefills
                 if span.samples]
        if batch.decode_tables is not None:
            n = batch.decode_start
            parts.append(self._decode(i, window, q[n:], batch, kv, masks, scale, softcap))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    @staticmethod
    def _last_row(span, i, window, q, k, v, kv, scale, softcap) -> torch.Tensor:
        ks, vs = TorchAttention._span_kv(span, i, q, k, v, kv)
        if window is not None:
            ks, vs = ks[:, :, -window:], vs[:, :, -window:]
        qs = q[span.end - 1 : span.end].transpose(0, 1).unsqueeze(0)
        return attend(qs, ks, vs, scale=scale, softcap=softcap).squeeze(0).transpose(0, 1)

    @staticmethod
    def _span_kv(span, i, q, k, v, kv) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefill span's keys and values [1, KVH, context, D]: its own new ones, or (after a prefix hit or an
        earlier chunk) its whole context gathered from the cache."""
        if span.num_cached == 0:
            kc, vc = k[span.start : span.end], v[span.start : span.end]
        else:
            kc, vc = kv.gather(i, span.context_rows)
        return kc.to(q.dtype).transpose(0, 1).unsqueeze(0), vc.to(q.dtype).transpose(0, 1).unsqueeze(0)

    @staticmethod
    def _prefill_span(s, span, i, window, q, k, v, kv, masks: dict, scale, softcap) -> torch.Tensor:
        qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0)
        n_new = span.end - span.start
        ks, vs = TorchAttention._span_kv(span, i, q, k, v, kv)
        if span.num_cached == 0 and window is None:
            o = attend(qs, ks, vs, causal=True, scale=scale, softcap=softcap)
        elif window is None and softcap is None:
            o = prefix_attend(qs, ks, vs, span.num_cached, scale=scale)
        else:
            key = ("prefill", s, window)
            if key not in masks:
                masks[key] = causal_mask(n_new, span.num_cached + n_new, window, q.device)
            o = attend(qs, ks, vs, mask=masks[key], scale=scale, softcap=softcap)
        return o.squeeze(0).transpose(0, 1)

    @staticmethod
    def _decode(i, window, qd, batch, kv, masks: dict, scale, softcap) -> torch.Tensor:
        mask = batch.decode_mask
        if window is not None:
            key = ("decode", window)
            if key not in masks:
                masks[key] = decode_window_mask(mask, batch.positions[batch.decode_start :], window)
            mask = masks[key]
        kc, vc = kv.gather(i, batch.decode_rows)  # [B, L, KVH, D]
        if softcap is None and qd.device.type == "cpu":  # grouped heads as one matmul (attention.py)
            key = ("decode_bias", window)
            if key not in masks:
                masks[key] = mask_bias(mask, qd.dtype)
            return decode_attend(qd, kc.to(qd.dtype), vc.to(qd.dtype), masks[key], scale)
        o = attend(qd.unsqueeze(2), kc.to(qd.dtype).transpose(1, 2), vc.to(qd.dtype).transpose(1, 2), mask=mask,
                   scale=scale, softcap=softcap)
        return o.squeeze(2)


def decode_starts(masks: dict, batch, window) -> torch.Tensor:
    """The first position each decode row attends to (0, or past the sliding window), once per step and window."""
    key = ("decode_starts", window)
    if key not in masks:
        pos = batch.positions[batch.decode_start :]
        masks[key] = torch.zeros_like(pos) if window is None else (pos - window + 1).clamp_(min=0)
    return masks[key]


class NativeAttention(TorchAttention):
    name = "native"

    @staticmethod
    def _decode(i, window, qd, batch, kv, masks: dict, scale, softcap) -> torch.Tensor:
        op = NativeAttention._op(qd, softcap, kv)
        if op is None:
            return TorchAttention._decode(i, window, qd, batch, kv, masks, scale, softcap)
        scale = scale if scale is not None else qd.shape[-1] ** -0.5
        return op(qd, kv.layer(i), batch.decode_tables, decode_starts(masks, batch, window), batch.decode_ends, scale)

    @staticmethod
    def _op(q: torch.Tensor, softcap, kv):
        """The C++ decode attention where it applies: CPU, float32/bfloat16 in q and the cache (or an fp8
        cache: it reads the rows and their scales), a head size it has, no soft-capping; else None."""
        if (softcap is not None or q.device.type != "cpu" or (q.dtype != kv.dtype and not kv.fp8)
                or q.dtype not in (torch.float32, torch.bfloat16) or q.shape[-1] not in native.HEAD_DIMS):
            return None
        return native.paged_decode_attention()


class TritonAttention:
    name = "triton"
    reads_tables = True

    def attend(self, i, window, q, k, v, batch, kv, masks: dict, scale, softcap) -> torch.Tensor:
        """The paged Triton kernels reading the KV blocks in place: one varlen launch for every prefill span
        (prefix hits and chunks included: their new K/V are in the cache already), one flash-decoding launch
        for every decode row."""
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        out = torch.empty_like(q)
        n = batch.decode_start
        if batch.prefills:
            starts = [span.start for span in batch.prefills]
            lens = [span.end - span.start for span in batch.prefills]
            out[:n] = gpu_attention.paged_prefill(q[:n], kv.layer(i), batch.prefill_tables, starts, lens,
                                                  batch.prefill_ctx_lens, scale, softcap=softcap, window=window)
        if batch.decode_tables is not None:
            out[n:] = gpu_attention.paged_decode(q[n:], kv.layer(i), batch.decode_tables,
                                                 decode_starts(masks, batch, window), batch.decode_ends, scale,
                                                 softcap=softcap)
        return out


BACKENDS = {b.name: b for b in (TorchAttention(), NativeAttention(), TritonAttention())}


def backend(name: str):
    """The backend a ForwardBatch names."""
    return BACKENDS[name]


def choose(kv, device: torch.device, native_kernels: bool = True) -> str:
    """The engine's backend, once: the Triton kernels on CUDA where they take this cache's shapes; on CPU the
    C++ decode kernel unless switched off (EngineConfig.native_kernels) or not buildable; else torch."""
    if gpu_attention.usable(kv):
        return "triton"
    if device.type == "cpu" and native_kernels and native.paged_decode_attention() is not None:
        return "native"
    if kv.fp8 and device.type == "cuda":
        log.warning("--kv-cache-dtype fp8 on CUDA: attention dequantizes the gathered rows in torch (the paged "
                    "Triton kernels read 16/32-bit rows only); correct, slower than --kv-cache-dtype auto")
    return "torch"
