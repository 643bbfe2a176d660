"""KVCache: the whole paged KV pool as ONE tensor.

Layout (a contract with the CacheStore, which registers this memory once)::

    tensor[num_layers, num_blocks, 2 (K, V), block_size, num_kv_heads, row]

``row`` is ``head_dim`` values of the model's dtype (``kv_dtype="auto"``), or with
``kv_dtype="fp8"`` ``head_dim + 2`` bytes (uint8): the row's values in float8_e4m3fn and its own
bfloat16 scale (``kv_formats.py`` why, ``kv_quant.py`` how). Either way a block is
``block_nbytes`` contiguous bytes per layer holding everything needed to read it back, scales
included, so whatever moves or stores whole blocks (CacheStore, checksums, swap, tiers, KV pool)
needs no change for fp8. ``write`` quantizes, ``gather`` dequantizes to the model's dtype
(``compute_dtype``).

So the bytes of (layer, block) start at ``(layer * num_blocks + block) * block_nbytes`` and the
blocks of one layer with contiguous ids form one contiguous byte range. ``layer(i)`` is a view
(no copy) of one layer's blocks.

Token slots: token ``t`` of a request lives in block ``block_table[t // block_size]`` at offset
``t % block_size``. ``slot_indices`` turns block ids + offsets into row indices of the flat
per-layer view ``[num_blocks * 2 * block_size, num_kv_heads, row]`` (the K row; the V row
is ``block_size`` further).
"""

from __future__ import annotations

import torch

from . import kv_quant, kv_shared
from .kv_formats import SCALE_BYTES, check_kv_dtype


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        kv_dtype: str = "auto",
        shared: bool = False,
    ):
        """``dtype``: the model's (what ``gather`` returns); ``kv_dtype``: "auto" (rows in ``dtype``) or "fp8";
        ``shared`` (cpu): the pool in shared memory another process of this machine may map (``kv_shared.py``,
        ``shared_fd`` its fd; same-node P/D)."""
        self.kv_dtype = check_kv_dtype(kv_dtype)
        self.compute_dtype = dtype
        self.fp8 = kv_dtype == "fp8"
        self.row_width = head_dim + SCALE_BYTES if self.fp8 else head_dim  # storage elements per row
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_layers, num_blocks, 2, block_size, num_kv_heads, self.row_width)
        storage_dtype = torch.uint8 if self.fp8 else dtype
        self.shared_fd: int | None = None
        if shared and torch.device(device).type == "cpu":
            self.tensor, self.shared_fd = kv_shared.shared_zeros(shape, storage_dtype)
        else:
            self.tensor = torch.zeros(shape, dtype=storage_dtype, device=device)
        self._flat = self.tensor.view(num_layers, num_blocks * 2 * block_size, num_kv_heads, self.row_width)
        self._written: list = [None] * num_layers  # CUDA: an event after each layer's last marked write

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype: the model's, or uint8 for fp8 rows (``compute_dtype`` is the model's)."""
        return self.tensor.dtype

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block of every layer, as ``tensor[:, block]`` is shaped: ``[num_layers, 2, block_size, KVH, row]``."""
        return (self.num_layers, *self.tensor.shape[2:])

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of one layer (K and V)."""
        return 2 * self.block_size * self.num_kv_heads * self.row_width * self.tensor.element_size()

    @property
    def layer_nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.layer_nbytes

    def block_offset(self, layer: int, block: int) -> int:
        """Byte offset of (layer, block) from the start of ``tensor``."""
        return (layer * self.num_blocks + block) * self.block_nbytes

    def layer(self, layer: int) -> torch.Tensor:
        """View ``[num_blocks, 2, block_size, num_kv_heads, row]`` of one layer (the storage rows)."""
        return self.tensor[layer]

    def flat_layer(self, layer: int) -> torch.Tensor:
        """View ``[num_blocks * 2 * block_size, num_kv_heads, row]``: one storage row per K or V slot."""
        return self._flat[layer]

    def slot_indices(self, block_ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """K-row indices in ``flat_layer`` of the slots (block_ids[i], offsets[i]); V rows are + block_size."""
        return block_ids * (2 * self.block_size) + offsets

    def write(self, layer: int, k_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write K/V ``[T, num_kv_heads, head_dim]`` at the K rows ``k_rows`` [T] of one layer; returns K/V as
        a later ``gather`` reads them back (fp8: dequantized, so attention over the new tokens sees the
        cache's values whether or not a prefix was cached; else ``k, v`` themselves)."""
        flat = self._flat[layer]
        if not self.fp8:
            flat.index_copy_(0, k_rows, k.to(flat.dtype))
            flat.index_copy_(0, k_rows + self.block_size, v.to(flat.dtype))
            return k, v
        kq, vq = kv_quant.quantize(k), kv_quant.quantize(v)
        flat.index_copy_(0, k_rows, kq)
        flat.index_copy_(0, k_rows + self.block_size, vq)
        return kv_quant.dequantize(kq, k.dtype), kv_quant.dequantize(vq, v.dtype)

    def mark_written(self, layer: int) -> None:
        """The K/V writes of ``layer`` queued so far on the current stream are what a reader on another
        thread (the CacheStore's link) must wait for: a CUDA event recorded now, so the engine thread goes
        on to the next layer instead of synchronizing its stream. No-op on CPU (writes are done on return)."""
        if self.tensor.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.tensor.device))
            self._written[layer] = event

    def written_waiter(self, layer: int):
        """A callable that blocks until the writes of ``layer`` marked so far are done; None when
        nothing needs waiting (CPU, or never marked). For ``MemoryRegion(layer_written=...)``."""
        event = self._written[layer]
        return None if event is None else event.synchronize

    def gather(self, layer: int, k_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at the K rows ``k_rows`` (any shape S) -> two tensors ``[*S, num_kv_heads, head_dim]``
        (fp8 rows dequantized to ``compute_dtype``)."""
        flat = self._flat[layer]
        flat_rows = k_rows.reshape(-1)
        k = flat.index_select(0, flat_rows)
        v = flat.index_select(0, flat_rows + self.block_size)
        if self.fp8:
            k, v = kv_quant.dequantize(k, self.compute_dtype), kv_quant.dequantize(v, self.compute_dtype)
        shape = (*k_rows.shape, self.num_kv_heads, self.head_dim)
        return k.view(shape), v.view(shape)

    def table_rows(self, block_table: torch.Tensor) -> torch.Tensor:
        """K rows of every slot of padded block tables ``[B, nb]`` -> ``[B, nb * block_size]``."""
        offs = torch.arange(self.block_size, device=block_table.device)
        rows = self.slot_indices(block_table.unsqueeze(-1), offs)
        return rows.reshape(*block_table.shape[:-1], -1)
