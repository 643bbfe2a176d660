"""A slice of a rank's KV heads made contiguous: the staging pool of a partial piece of the per-rank push.

The KV pool is ``[layers, blocks, 2, block_size, heads, row]``: a block's heads are interleaved per token row, so
a head range that is only part of a rank's heads is strided inside each block, and the CacheStore moves whole
blocks of one region (a layer of a block is ``block_nbytes`` contiguous bytes). A ``HeadSlice`` is a second pool
``[layers, blocks, 2, block_size, len(heads), row]`` under the same block ids as the rank's pool: exactly the
block layout of a rank that holds only those heads, so its blocks go on the wire as any rank's.

- Prefill (pack on send): a decode rank needs part of our rank's heads (2 KV heads from TP 1 into TP 2).
  After each layer is written, ``pack(layer, blocks)`` copies that slice of the pushed blocks into the staging
  pool, which the piece's own CacheStore sender reads (``prefill_server/rank_senders.py``); the decode rank's
  receiver lands it straight in its pool (its whole shard).
- Decode (unpack on receive): our rank needs heads from several prefill ranks (TP 2 into TP 1). Each prefill
  rank's whole shard lands in the staging pool of those heads (its own CacheStore receiver); once every piece
  of the request arrived, ``unpack(blocks)`` copies every layer of them into the rank's pool
  (``decode_server/rank_receivers.py``), before the request joins the batch.

The staging pool is allocated at the first request that needs it (``torch.empty``, or a memfd on a decode that
offers same-node transfers: pages are touched only for the blocks used) and held for the server's life; its
block b is only ever used by the request that owns block b of the rank's pool, so no second allocator is needed.
Its price: up to one more pool's memory per slice in use (not counted in the KV pool's sizing), and one copy
of the slice's bytes per layer on the side that packs or unpacks. On the CPU the rank pools are mapped in rank
0's process (``rank_pools.py``), where these copies run: no collective, no rank 0 pool on the path.
"""

from __future__ import annotations

import os

import torch

from .. import kv_shared


class HeadSlice:
    """Heads ``heads`` (the model's numbering) of the rank pool ``pool`` whose heads are ``rank_heads``."""

    def __init__(self, pool: torch.Tensor, rank_heads: range, heads: range, shared: bool = False):
        """``shared`` (CPU): the staging pool in a memfd (``../kv_shared.py``), so a decode offers it to same-node
        senders as it does its pools; ``shared_fd`` is then its fd (closed by ``close``)."""
        if not (rank_heads.start <= heads.start < heads.stop <= rank_heads.stop) or heads == rank_heads:
            raise ValueError(f"KV heads {heads.start}..{heads.stop - 1} are not a part of the rank's "
                             f"{rank_heads.start}..{rank_heads.stop - 1}")
        self.pool, self.heads = pool, heads
        self.lo, self.hi = heads.start - rank_heads.start, heads.stop - rank_heads.start
        shape = list(pool.shape)
        shape[4] = len(heads)
        self.shared_fd: int | None = None
        if shared and pool.device.type == "cpu" and kv_shared.available():
            self.tensor, self.shared_fd = kv_shared.shared_zeros(tuple(shape), pool.dtype)
        else:
            self.tensor = torch.empty(shape, dtype=pool.dtype, device=pool.device)

    def pack(self, layer: int, blocks: list[int]) -> None:
        """The prefill: the slice of ``blocks`` of ``layer`` from the rank's pool into the staging pool."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.pool.device)
        self.tensor[layer].index_copy_(0, idx, self.pool[layer].index_select(0, idx)[..., self.lo:self.hi, :])

    def unpack(self, blocks: list[int]) -> None:
        """The decode: every layer of ``blocks`` from the staging pool into the slice of the rank's pool."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.pool.device)
        self.pool[:, idx, :, :, self.lo:self.hi, :] = self.tensor.index_select(1, idx)

    def close(self) -> None:
        """Close the memfd (``shared``; the mapping lives while the tensor does)."""
        if self.shared_fd is not None:
            os.close(self.shared_fd)
            self.shared_fd = None

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()
