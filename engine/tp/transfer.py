"""KV in and out of a tensor-parallel engine (P/D): gathered at rank 0 for the push, scattered from rank 0 on arrival.

Each rank's pool holds only its KV heads (``shard.py``), under the same block ids (rank 0 schedules). The
CacheStore moves whole blocks of one memory region, so a tensor-parallel engine that moves KV keeps one
more pool on rank 0, the *transfer pool* (``KVTransferPool``): every block id of the engine's pool, with the
whole model's KV heads, the region its server's CacheStore registers. What the wire carries is therefore
exactly what a TP 1 server's pool holds: any prefill TP size pairs with any decode TP size, and with TP 1
peers, with no change to the CacheStore's bytes.

- Prefill (the push): a step with remote prefills that complete blocks (``remote_prefill.layer_callback``:
  its ``blocks``) is sent to the workers with those block ids. After each layer's KV is written, every
  rank's heads of those blocks are gathered to rank 0 (one collective per layer), which writes each rank's
  heads into the transfer pool, then calls the step's ``on_layer`` (the CacheStore reads the transfer
  pool from there on). The push stays layer by layer, overlapped with the next layers' compute.
- Decode (the arrival): the KV lands in rank 0's transfer pool (the CacheStore writes it there). Before the
  request joins the batch (``PDHooks.add_prefilled``), ``install(blocks)``: rank 0 sends the block ids to
  the workers and scatters to each rank its heads of those blocks, every layer (one collective); each
  rank copies them into its pool.

Replicated KV heads (fewer KV heads than ranks): ranks holding the same head hold the same values; the
gather writes that head once per rank (the same bytes), the scatter gives each rank its copy.

Why not each rank pushing its own shard on its own link (the per-rank design, DESIGN.md)? It needs a
CacheStore sender and receiver per rank (worker processes with their own event loops and endpoints), a
Session carrying one endpoint per decode rank, and transfers addressed by head range (a head shard of a
block is not contiguous in the pool layout ``[.., block, 2, block_size, heads, row]``). The CacheStore
contract carries a region's head range already (``CompatInfo.kv_heads``) so that change can come without a
wire break; the price of this design is rank 0's transfer pool (memory: the whole model's KV for every
block, counted when the pool is sized) and one gather or scatter per layer through rank 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..kv_cache import KVCache

if TYPE_CHECKING:
    from .group import TPGroup


class KVTransferPool:
    """Rank 0's whole-heads copy of the pool's blocks (see the module), and the head range of every rank."""

    def __init__(self, kv: KVCache, num_kv_heads: int, rank_heads: list[range]):
        self.pool, self.rank_heads = kv, rank_heads
        self.cache = KVCache(kv.num_layers, kv.num_blocks, kv.block_size, num_kv_heads, kv.head_dim,
                             kv.compute_dtype, kv.device, kv.kv_dtype)

    @property
    def tensor(self) -> torch.Tensor:
        return self.cache.tensor

    def _heads(self, rank: int, layer: int | None = None) -> torch.Tensor:
        """A view of the transfer pool: ``rank``'s heads of every block (of ``layer``, or every layer)."""
        heads = self.rank_heads[rank]
        whole = self.cache.tensor if layer is None else self.cache.tensor[layer]
        return whole[..., heads.start:heads.stop, :]

    def gathered(self, group: TPGroup, layer: int, blocks: torch.Tensor) -> None:
        """Rank 0, the push: every rank's heads of ``blocks`` in ``layer`` into the transfer pool."""
        parts = group.gather(self.pool.tensor[layer].index_select(0, blocks))
        dst = blocks.to(self.cache.device)
        for rank, part in enumerate(parts):
            self._heads(rank, layer).index_copy_(0, dst, part.to(self.cache.device))
        self.cache.mark_written(layer)

    def install(self, group: TPGroup, blocks: list[int]) -> None:
        """Rank 0, the arrival: ``blocks`` (every layer) from the transfer pool into every rank's pool
        (the workers were sent the block ids first: ``TensorParallelSteps.install``)."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.cache.device)
        parts = [self._heads(rank).index_select(1, idx) for rank in range(len(self.rank_heads))]
        mine = group.scatter(parts)
        self.pool.tensor.index_copy_(1, idx.to(self.pool.device), mine.to(self.pool.device))


def send_layer(group: TPGroup, kv: KVCache, layer: int, blocks: torch.Tensor) -> None:
    """A worker, the push: its heads of ``blocks`` in ``layer`` to rank 0 (``KVTransferPool.gathered``)."""
    group.gather(kv.tensor[layer].index_select(0, blocks.to(kv.device)))


def receive_blocks(group: TPGroup, kv: KVCache, blocks: list[int]) -> None:
    """A worker, the arrival: its heads of ``blocks`` (every layer) from rank 0 into its pool."""
    idx = torch.tensor(blocks, dtype=torch.long, device=kv.device)
    shape = (kv.num_layers, len(blocks), *kv.tensor.shape[2:])
    part = group.scatter([], torch.empty(shape, dtype=kv.tensor.dtype, device=kv.device))
    kv.tensor.index_copy_(1, idx, part)
