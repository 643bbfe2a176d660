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

Checksums per shard (``checksum``: the servers' ``--kv-checksum``): the wire's CRC32C per slice covers rank
0's transfer pool to the decode's; each rank's shard is summed on both sides of rank 0's hop too, so every
shard is checked from the prefill rank's pool to the decode rank's. The push: each rank sums its shard of the
layer's blocks, rank 0 sums each where it landed in the transfer pool (a mismatch fails the step's pushing
requests: ``ShardChecksumError``; their KV is never stored). The arrival: rank 0 sums each rank's shard
before it scatters, each rank where it landed in its pool, and the ranks agree on the outcome (a mismatch
fails the request before it joins the batch). Either way the ranks stay in step.

This is the fallback since the per-rank push (``rank_pools.py``: each piece of a rank's heads on its own
CacheStore link, straight from its pool, or a staging pool of a slice of it, ``pieces.py``, into the decode ranks
that hold those heads, no transfer pool on the path) landed; it serves a peer that does not speak the per-rank
push (``Compat.kv_push``, protos/version.py) or speaks only version 1 (whole shards) for a pairing that needs
slices, ``--kv-push gather``, and CUDA (the ranks' pools are not mapped into rank 0's process there). Its price:
rank 0's transfer pool (memory: the whole model's KV for every block, counted when the pool is sized) and one
gather or scatter per layer through rank 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import ShardChecksumError
from ..kv_cache import KVCache

if TYPE_CHECKING:
    from .group import TPGroup


class KVTransferPool:
    """Rank 0's whole-heads copy of the pool's blocks (see the module), and the head range of every rank."""

    def __init__(self, kv: KVCache, num_kv_heads: int, rank_heads: list[range], shared: bool = False):
        """``shared``: the transfer pool in shared memory (CPU; same-node P/D maps it: ../kv_shared.py)."""
        self.pool, self.rank_heads = kv, rank_heads
        self.cache = KVCache(kv.num_layers, kv.num_blocks, kv.block_size, num_kv_heads, kv.head_dim,
                             kv.compute_dtype, kv.device, kv.kv_dtype, shared)

    @property
    def tensor(self) -> torch.Tensor:
        return self.cache.tensor

    def _heads(self, rank: int, layer: int | None = None) -> torch.Tensor:
        """A view of the transfer pool: ``rank``'s heads of every block (of ``layer``, or every layer)."""
        heads = self.rank_heads[rank]
        whole = self.cache.tensor if layer is None else self.cache.tensor[layer]
        return whole[..., heads.start:heads.stop, :]

    def gathered(self, group: TPGroup, layer: int, blocks: torch.Tensor, checksum: bool) -> list[int]:
        """Rank 0, the push: every rank's heads of ``blocks`` in ``layer`` into the transfer pool; the ranks
        whose shard did not land as they summed it (``checksum``; else [])."""
        parts = group.gather(self.pool.tensor[layer].index_select(0, blocks))
        sums = group.gather(shard_sum(parts[0]), small=True) if checksum else []
        dst = blocks.to(self.cache.device)
        for rank, part in enumerate(parts):
            self._heads(rank, layer).index_copy_(0, dst, part.to(self.cache.device))
        self.cache.mark_written(layer)
        return [rank for rank, expected in enumerate(sums)
                if int(expected) != int(shard_sum(self._heads(rank, layer).index_select(0, dst)))]

    def install(self, group: TPGroup, blocks: list[int], sums: list[int] | None) -> None:
        """Rank 0, the arrival: ``blocks`` (every layer) from the transfer pool into every rank's pool (the
        workers were sent the block ids and ``sums``, each rank's shard sum or None, first:
        ``TensorParallelSteps.install``). ShardChecksumError when a shard did not land intact on some rank."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.cache.device)
        parts = [self._heads(rank).index_select(1, idx) for rank in range(len(self.rank_heads))]
        mine = group.scatter(parts)
        at = idx.to(self.pool.device)
        self.pool.tensor.index_copy_(1, at, mine.to(self.pool.device))
        if sums is not None and agree_failed(group, int(shard_sum(self.pool.tensor.index_select(1, at))) != sums[0]):
            raise ShardChecksumError(f"kv_checksum_mismatch: a tensor-parallel rank's shard of KV blocks "
                                     f"{blocks[0]}..{blocks[-1]} did not land intact in its pool")

    def sums(self, blocks: list[int]) -> list[int]:
        """Each rank's shard sum of ``blocks`` (every layer) as the transfer pool holds them (sent with INSTALL)."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.cache.device)
        return [int(shard_sum(self._heads(rank).index_select(1, idx))) for rank in range(len(self.rank_heads))]


def shard_sum(t: torch.Tensor) -> torch.Tensor:
    """CRC32C of a shard's bytes (a one-element int64 tensor: what the gather moves)."""
    import crc32c

    data = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return torch.tensor([crc32c.crc32c(data)], dtype=torch.long)


def agree_failed(group: TPGroup, failed: bool) -> bool:
    """Whether any rank failed (every rank calls it: one all-reduce of the flags, on the CPU)."""
    flag = torch.tensor([1 if failed else 0], dtype=torch.long)
    group.payload.allreduce([flag]).wait()
    return int(flag) > 0


def send_layer(group: TPGroup, kv: KVCache, layer: int, blocks: torch.Tensor, checksum: bool) -> None:
    """A worker, the push: its heads of ``blocks`` in ``layer`` to rank 0 (``KVTransferPool.gathered``), and with
    ``checksum`` their sum."""
    part = kv.tensor[layer].index_select(0, blocks.to(kv.device))
    group.gather(part)
    if checksum:
        group.gather(shard_sum(part), small=True)


def receive_blocks(group: TPGroup, kv: KVCache, blocks: list[int], sums: list[int] | None) -> None:
    """A worker, the arrival: its heads of ``blocks`` (every layer) from rank 0 into its pool; with ``sums``
    (each rank's shard sum, from rank 0) checked where they landed, the outcome agreed with every rank."""
    idx = torch.tensor(blocks, dtype=torch.long, device=kv.device)
    shape = (kv.num_layers, len(blocks), *kv.tensor.shape[2:])
    part = group.scatter([], torch.empty(shape, dtype=kv.tensor.dtype, device=kv.device))
    kv.tensor.index_copy_(1, idx, part)
    if sums is not None:
        agree_failed(group, int(shard_sum(kv.tensor.index_select(1, idx))) != sums[group.rank])
