"""Every rank's KV pool, mapped in rank 0's process: what the per-rank push moves (P/D on the CPU).

A worker rank of an engine started with ``shared_pools`` (``EngineConfig.kv_transfer`` and ``kv_push_per_rank``,
CPU) allocates its pool in a memfd (``../kv_shared.py``: anonymous shared memory, mode 0600, gone with the last
process that maps it) and names it in the ranks' store (``pool/<rank>``: pid, fd, inode) before the barrier;
rank 0 maps each after the barrier (``/proc/<pid>/fd/<fd>``, the inode checked). Rank 0's server then runs one
CacheStore sender (prefill) or receiver (decode) per rank on these pools, each with its own port or NIXL agent
and a compat naming the rank's head range (``pdserve/server_setup.py`` ``rank_parts``), so a rank's KV heads
leave from, or land in, its own pool on their own link: no gather to rank 0, no scatter from it, no transfer
pool on the wire's path (``heads.rank_sources`` says which prefill rank feeds which decode rank).

What stays with the ranks' collectives: on a push, the ranks agree after each layer that every rank has written
it (``TPGroup.sync``, a one-element all-reduce through shared memory) before rank 0 hands the layer to the
senders; on an arrival, the blocks are in every rank's pool once every rank's receiver has them all, before the
request joins the batch (no scatter: ``LLMEngine.kv_landed``).

On CUDA the pools are not mapped here (a GPU's memory would need CUDA IPC into rank 0's process): the per-rank
push is not offered there and the KV goes through rank 0's transfer pool (``transfer.py``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import kv_shared
from ..kv_cache import KVCache


@dataclass(slots=True)
class RankPool:
    """One rank's KV pool as rank 0 sees it: the tensor (rank 0's own, or mapped), the fd it lives in (None: rank
    0's pool when not shared) and the rank's KV heads of the model's."""

    rank: int
    tensor: torch.Tensor
    shared_fd: int | None
    heads: range


def publish(store: dist.Store, rank: int, kv: KVCache) -> None:
    """A worker: name its pool's memfd to rank 0 (before the barrier)."""
    assert kv.shared_fd is not None
    store.set(f"pool/{rank}", json.dumps(kv_shared.describe(kv.shared_fd)))


def map_pools(store: dist.Store, own: KVCache, heads: list[range]) -> list[RankPool]:
    """Rank 0, after the barrier: every rank's pool (its own first), the workers' mapped from their memfds (each
    rank's pool has rank 0's shape: the same blocks and, split or replicated, as many KV heads)."""
    pools = [RankPool(0, own.tensor, own.shared_fd, heads[0])]
    for rank in range(1, len(heads)):
        desc = json.loads(store.get(f"pool/{rank}").decode())
        tensor, fd = kv_shared.open_shared(desc, tuple(own.tensor.shape), own.tensor.dtype)
        pools.append(RankPool(rank, tensor, fd, heads[rank]))
    return pools


def close_pools(pools: list[RankPool]) -> None:
    """Rank 0: close the fds of the mapped pools (the mappings go with their tensors)."""
    for pool in pools[1:]:
        if pool.shared_fd is not None:
            os.close(pool.shared_fd)
            pool.shared_fd = None
