"""What the CacheStore knows about memory: one registered region and the KV layout inside it.

The engine keeps its whole KV pool in ONE tensor laid out
``[num_layers, num_blocks, 2 (K, V), block_size, num_kv_heads, row]`` (a row: ``head_dim`` values
of ``dtype``, or with ``kv_dtype="fp8"`` ``head_dim`` fp8 bytes and a 2-byte scale; the engine's
``kv_quant.py`` is the contract; the CacheStore only needs the row's size); the bytes of
``(layer, block)`` start at ``(layer * num_blocks + block) * block_nbytes``, so contiguous
block ids of one layer form one contiguous byte range. The CacheStore never sees engine
classes: a ``MemoryRegion`` (base pointer, length, device) plus a ``KVLayout``.
"""

from __future__ import annotations

import ctypes
import operator
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

# The bytes of one element for each dtype name CompatInfo accepts.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1}
KV_DTYPES = ("auto", "fp8")  # CompatInfo.kv_dtype: the engine's --kv-cache-dtype choices (engine/kv_quant.py)
FP8_SCALE_BYTES = 2  # an fp8 row: head_dim bytes then its bfloat16 scale (engine/kv_quant.py's row)


@dataclass(slots=True, frozen=True)
class KVLayout:
    """How (layer, block) maps to bytes of the region: ``(layer*num_blocks + block) * block_nbytes``."""

    num_layers: int
    num_blocks: int
    block_nbytes: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_nbytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.num_blocks * self.block_nbytes

    def offset(self, layer: int, block: int) -> int:
        """Byte offset of (layer, block) inside the region."""
        return (layer * self.num_blocks + block) * self.block_nbytes

    def check_layer(self, layer: Any) -> int:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer!r} out of range 0..{self.num_layers - 1}")
        return layer

    def check_blocks(self, block_ids: Sequence[int], what: str = "block id", allow_skip: bool = False) -> list[int]:
        """Validate a list of block ids (ints in range, no duplicates); -1 allowed when allow_skip."""
        out: list[int] = []
        seen: set[int] = set()
        for raw in block_ids:
            if isinstance(raw, bool):
                raise ValueError(f"{what} {raw!r} is not an int")
            try:
                b = operator.index(raw)
            except TypeError:
                raise ValueError(f"{what} {raw!r} is not an int") from None
            if allow_skip and b == -1:
                out.append(b)
                continue
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"{what} {b} out of range 0..{self.num_blocks - 1}")
            if b in seen:
                raise ValueError(f"{what} {b} appears twice")
            seen.add(b)
            out.append(b)
        return out


@dataclass(slots=True, frozen=True)
class CompatInfo:
    """What both peers must agree on before any byte moves; hashed into ``compat_hash``."""

    dtype: str  # the model's
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: str = "auto"  # "auto": rows of ``dtype``; "fp8": fp8 rows with their scales (--kv-cache-dtype)
    # The KV heads a block of this region holds: ``num_kv_heads`` of the model's ``model_kv_heads`` from
    # ``first_kv_head`` (a tensor-parallel rank's shard); model_kv_heads 0: every head (the servers' regions
    # today: engine/tp/transfer.py). Two regions of different head ranges never bind (their hashes differ)
    first_kv_head: int = 0
    model_kv_heads: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"CompatInfo.dtype {self.dtype!r} unknown; expected one of {sorted(DTYPE_BYTES)}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"CompatInfo.kv_dtype {self.kv_dtype!r} unknown; expected one of {', '.join(KV_DTYPES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"CompatInfo.{name} must be a positive int, got {value!r}")
        if self.model_kv_heads and not 0 <= self.first_kv_head <= self.model_kv_heads - self.num_kv_heads:
            raise ValueError(f"CompatInfo: KV heads {self.first_kv_head}..{self.first_kv_head + self.num_kv_heads - 1}"
                             f" are not heads of a model with {self.model_kv_heads}")

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of one layer (K and V)."""
        row = self.head_dim + FP8_SCALE_BYTES if self.kv_dtype == "fp8" else self.head_dim * DTYPE_BYTES[self.dtype]
        return 2 * self.block_size * self.num_kv_heads * row

    def describe(self) -> str:
        """The fields in words (hashed into ``compat_hash``; "kv_cache=fp8" only for an fp8 cache, so an auto
        one hashes as before the field existed)."""
        kv = " kv_cache=fp8(float8_e4m3fn+bfloat16 scales)" if self.kv_dtype == "fp8" else ""
        return (f"dtype={self.dtype}{kv} layers={self.num_layers} kv_heads={self.num_kv_heads}{self._head_range()} "
                f"head_dim={self.head_dim} block_size={self.block_size}")

    def _head_range(self) -> str:
        """The head range in words, ``(first..last of N)``, for a region holding part of the model's KV heads;
        empty for every head (so a whole region hashes as before the fields existed)."""
        if not self.model_kv_heads or (self.first_kv_head == 0 and self.num_kv_heads == self.model_kv_heads):
            return ""
        last = self.first_kv_head + self.num_kv_heads - 1
        return f"({self.first_kv_head}..{last} of {self.model_kv_heads})"

    @property
    def compat_hash(self) -> str:
        return hashlib.sha256(self.describe().encode()).hexdigest()[:16]

    def check_layout(self, layout: KVLayout) -> None:
        if layout.num_layers != self.num_layers:
            raise ValueError(f"KVLayout has {layout.num_layers} layers but CompatInfo says {self.num_layers}")
        if layout.block_nbytes != self.block_nbytes:
            raise ValueError(f"KVLayout.block_nbytes={layout.block_nbytes} but CompatInfo ({self.describe()}) "
                             f"implies {self.block_nbytes}")


@dataclass(slots=True)
class MemoryRegion:
    """One registered memory range: base pointer, length, device ('cpu' or 'cuda') and device id.

    Build it from the engine's pool tensor with ``from_tensor`` (the region keeps the tensor
    alive). Registered once at start-up; transfers address it by byte offsets.
    """

    ptr: int
    nbytes: int
    device: str = "cpu"
    device_id: int = 0
    owner: Any = field(default=None, repr=False)  # keeps the backing tensor alive
    # a writer that runs ahead of its device (a CUDA stream): layer -> a callable that blocks until that
    # layer's writes queued so far are done (None: done already); None: every write is done when stored
    layer_written: Callable[[int], Callable[[], None] | None] | None = field(default=None, repr=False)
    # cpu: the memfd the region lives in (engine/kv_shared.py), so a process on this node can map it (samenode.py)
    shared_fd: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.ptr, int) or self.ptr <= 0:
            raise ValueError(f"MemoryRegion.ptr must be a positive address, got {self.ptr!r}")
        if not isinstance(self.nbytes, int) or self.nbytes <= 0:
            raise ValueError(f"MemoryRegion.nbytes must be positive, got {self.nbytes!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"MemoryRegion.device must be 'cpu' or 'cuda', got {self.device!r}")

    @classmethod
    def from_tensor(cls, tensor: Any, layer_written=None, shared_fd: int | None = None) -> "MemoryRegion":
        """The whole storage of a contiguous torch tensor (or numpy array) as one region; ``shared_fd``: the
        memfd it lives in (cpu, for same-node senders)."""
        if hasattr(tensor, "data_ptr"):  # torch
            if not tensor.is_contiguous():
                raise ValueError("MemoryRegion.from_tensor needs a contiguous tensor (the whole KV pool)")
            device = tensor.device.type
            if device not in ("cpu", "cuda"):
                raise ValueError(f"tensor on device {tensor.device} is not supported (cpu or cuda)")
            return cls(tensor.data_ptr(), tensor.numel() * tensor.element_size(), device,
                       tensor.device.index or 0, owner=tensor, layer_written=layer_written,
                       shared_fd=shared_fd if device == "cpu" else None)
        if hasattr(tensor, "__array_interface__"):  # numpy
            if not tensor.flags["C_CONTIGUOUS"]:
                raise ValueError("MemoryRegion.from_tensor needs a C-contiguous array")
            return cls(tensor.__array_interface__["data"][0], tensor.nbytes, "cpu", 0, owner=tensor)
        raise TypeError(f"MemoryRegion.from_tensor takes a torch tensor or numpy array, got {type(tensor).__name__}")

    def check_layout(self, layout: KVLayout) -> None:
        if layout.nbytes > self.nbytes:
            raise ValueError(f"KVLayout needs {layout.nbytes} bytes but the region has {self.nbytes}")

    def host_view(self) -> memoryview:
        """A writable byte memoryview over the region (cpu only): no copy, sliced per transfer."""
        if self.device != "cpu":
            raise ValueError("host_view() is only for cpu regions; cuda regions are staged through pinned buffers")
        return memoryview((ctypes.c_ubyte * self.nbytes).from_address(self.ptr)).cast("B")


def merge_runs(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """Pair src[i] -> dst[i] and merge neighbours contiguous on BOTH sides into runs.

    Returns ``[(src_start, dst_start, count), ...]`` in input order; pairs whose dst is -1
    (already present on the receiver) are skipped.
    """
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks")
    runs: list[list[int]] = []
    for s, d in zip(src_blocks, dst_blocks):
        if d == -1:
            continue
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [(s, d, n) for s, d, n in runs]
