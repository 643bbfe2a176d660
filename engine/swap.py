"""Swap: a running sequence's KV moved out of the pool to host memory and back, bit for bit.

QLM's LSO eviction on the decode side (``pdserve.decode_server.lso`` decides when): a batch
request whose place in the running batch slows an interactive one is taken out of the batch,
its KV copied to host memory and its blocks freed (other requests may take them); later it is
copied into fresh blocks and rejoins the batch where it left off. Nothing is recomputed: the
KV that comes back is the KV that left, so greedy output is identical.

- ``evict`` copies every layer's blocks of the sequence (all of its table, prefix-cache blocks
  included) into ONE host tensor ``[num_layers, n, 2, block_size, kv_heads, head_dim]``
  (pinned host memory when the pool is on a GPU), frees the blocks, and parks the sequence in
  ``Scheduler.swapped``. The host copy lives on the Sequence: an abort drops both at once.
- ``restore`` takes ``n`` fresh blocks (OutOfBlocksError when they are not free: stay
  swapped), copies the tensor back, and the sequence rejoins the running batch; its full
  blocks are registered in the prefix cache again at its next step.

Both run on the engine thread between steps.
"""

from __future__ import annotations

import torch

from .errors import OutOfBlocksError
from .kv_cache import KVCache
from .scheduler import Scheduler
from .sequence import Sequence, Status


class Swapper:
    def __init__(self, scheduler: Scheduler, kv_cache: KVCache):
        self.scheduler, self.kv = scheduler, kv_cache
        self.evictions = 0
        self.restores = 0
        self.kv_stays: str | None = None  # why KV may not leave the pool (tensor parallelism), or None

    def swapped_ids(self) -> list[str]:
        """Swapped-out requests, the first evicted first."""
        return list(self.scheduler.swapped)

    def swapped_bytes(self) -> int:
        return sum(host_kv(s).nbytes for s in self.scheduler.swapped.values())

    def evict(self, request_id: str) -> int:
        """Move a running sequence's KV to host memory and free its blocks: the bytes moved.
        ValueError when the request is not running."""
        seq = self.scheduler.seqs.get(request_id)
        if seq is None or seq.status is not Status.RUNNING or seq not in self.scheduler.running:
            raise ValueError(f"request {request_id!r} is not running: only a running request can be evicted")
        if self.kv_stays is not None:
            raise ValueError(self.kv_stays)
        index = torch.tensor(seq.block_table, dtype=torch.long, device=self.kv.device)
        host = self.kv.tensor.index_select(1, index).to("cpu")
        if self.kv.device.type == "cuda":
            host = host.pin_memory()
        seq.swapped_kv = host
        self.scheduler.swap_out(seq)
        self.evictions += 1
        return host.nbytes

    def blocks_to_restore(self, request_id: str) -> int:
        return host_kv(self.scheduler.swapped[request_id]).shape[1]

    def restore(self, request_id: str) -> bool:
        """Bring a swapped request back into fresh blocks and the running batch; False (nothing
        changed) when its blocks are not free now."""
        seq: Sequence = self.scheduler.swapped[request_id]
        host = host_kv(seq)
        try:
            table = self.scheduler.block_manager.allocate([], host.shape[1] * self.kv.block_size,
                                                          use_prefix_cache=False)[0]
        except OutOfBlocksError:
            return False
        index = torch.tensor(table, dtype=torch.long, device=self.kv.device)
        self.kv.tensor.index_copy_(1, index, host.to(self.kv.device, non_blocking=True))
        seq.swapped_kv = None
        self.scheduler.swap_in(seq, table)
        self.restores += 1
        return True


def host_kv(seq: Sequence) -> torch.Tensor:
    """A swapped sequence's KV on the host (``evict`` put it there)."""
    if seq.swapped_kv is None:
        raise ValueError(f"request {seq.request_id!r} has no KV on the host: it is not swapped out")
    return seq.swapped_kv
