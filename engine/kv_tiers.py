"""KV tiers below the pool: where prefix-cache blocks go when the pool evicts them.

Lifecycle of one block (``BlockManager`` drives it through ``KVTiers``; all on the engine thread):

1. The pool evicts a cached block (its last reference dropped long ago, a fresh allocation
   needs the slot): ``evict(hash, block)`` copies the block's KV, every layer, out of the pool
   into the host tier, before the slot is reused.
2. The host tier is over its byte budget: its least recently stored blocks move to the disk
   tier (one file each, with a CRC32C of the bytes kept in memory); the disk tier over its
   budget deletes its least recently stored files. Those hashes are gone for good: ``evict``
   returns them so the BlockManager can announce them removed (KV events).
3. A later prompt whose chained hashes reach past the pool's blocks into a tier: ``take(hash)``
   removes the entry from its tier (a disk entry is read back and its checksum checked: a
   mismatch or a missing file is a miss, counted, never wrong tokens), then ``restore(block,
   payload)`` copies it into a freshly allocated pool block. The tokens are not recomputed.

Exclusive: a hash lives in the pool or in exactly one tier. LRU per tier is by the time a block
entered that tier (a hit takes the entry out, so it re-enters on top when evicted again).

Copies: ``copy_block`` is the one copy between the pool and host memory, both ways. On GPU the
pool is device memory and the host tier's buffers are pinned (``pin_memory``), so it is a DMA;
on CPU both are plain tensors. Disk I/O is synchronous (the engine thread waits for it).

Who frees: ``close()`` deletes the disk tier's directory (a fresh ``pdserve-kv-tier-*`` folder
under ``disk_dir``, one per engine); it also runs when the KVTiers is collected or at exit.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import crc32c
import torch

from .kv_cache import KVCache

TIERS = ("host", "disk")
log = logging.getLogger(__name__)


@dataclass(slots=True)
class TierStats:
    """Running totals of one tier (metrics read them; ints and floats, safe to read off-thread)."""

    hits: int = 0  # blocks restored from this tier into the pool
    blocks: int = 0  # blocks held now
    bytes: int = 0  # bytes held now
    bytes_in: int = 0  # bytes moved into this tier
    bytes_out: int = 0  # bytes moved out of it (restored, or down to the next tier)
    seconds_in: float = 0.0  # time spent moving them in
    seconds_out: float = 0.0
    evictions: int = 0  # blocks that left for the next tier (or out) over the budget
    checksum_mismatches: int = 0  # disk: entries whose bytes failed the checksum (each a miss)
    write_errors: int = 0  # disk: blocks dropped because their file could not be written


def copy_block(dst: torch.Tensor, src: torch.Tensor) -> None:
    """The one copy between the pool and the host tier (either way round); see the module."""
    dst.copy_(src, non_blocking=dst.is_pinned() or src.is_pinned())
    if dst.is_cuda or src.is_cuda:
        torch.cuda.current_stream(dst.device if dst.is_cuda else src.device).synchronize()


class HostTier:
    """Blocks in host memory, LRU within ``budget`` bytes."""

    name = "host"

    def __init__(self, budget: int):
        self.budget = budget
        self.stats = TierStats()
        self._entries: OrderedDict[int, torch.Tensor] = OrderedDict()

    def __contains__(self, h: int) -> bool:
        return h in self._entries

    def put(self, h: int, payload: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """Store ``payload``; return the entries pushed out over the budget, oldest first."""
        self._entries[h] = payload
        self._account(payload.nbytes, +1)
        out = []
        while self.stats.bytes > self.budget:
            old, data = self._entries.popitem(last=False)
            self._account(data.nbytes, -1)
            self.stats.evictions += 1
            out.append((old, data))
        return out

    def take(self, h: int) -> torch.Tensor | None:
        data = self._entries.pop(h, None)
        if data is not None:
            self._account(data.nbytes, -1)
        return data

    def discard(self, h: int) -> None:
        self.take(h)

    def hashes(self) -> list[int]:
        return list(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.stats.blocks = self.stats.bytes = 0

    def _account(self, nbytes: int, sign: int) -> None:
        self.stats.blocks += sign
        self.stats.bytes += sign * nbytes


class DiskTier:
    """Blocks in files under a fresh directory, LRU within ``budget`` bytes, CRC32C-checked on read."""

    name = "disk"

    def __init__(self, root: str, budget: int, shape: tuple[int, ...], dtype: torch.dtype):
        os.makedirs(root, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="pdserve-kv-tier-", dir=root)
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.dir, True)
        self.budget, self.shape, self.dtype = budget, shape, dtype
        self.stats = TierStats()
        self._entries: OrderedDict[int, tuple[int, int]] = OrderedDict()  # hash -> (crc32c, nbytes)

    def path(self, h: int) -> str:
        return os.path.join(self.dir, f"{h & 0xFFFFFFFFFFFFFFFF:016x}.kv")

    def __contains__(self, h: int) -> bool:
        return h in self._entries

    def put(self, h: int, payload: torch.Tensor) -> list[int]:
        """Write ``payload`` to a file; return the hashes deleted over the budget, oldest first."""
        started = time.perf_counter()
        raw = payload.contiguous().view(-1).view(torch.uint8).numpy()
        try:
            with open(self.path(h), "wb") as f:
                f.write(raw.data)
        except OSError as exc:  # disk full, directory gone: the block is lost, the engine goes on
            self._unlink(h)
            self.stats.write_errors += 1
            log.warning("KV disk tier: cannot write a block to %s (%s); it is dropped", self.dir, exc)
            return [h]
        self._entries[h] = (crc32c.crc32c(raw.data), raw.nbytes)
        self.stats.seconds_in += time.perf_counter() - started
        self.stats.bytes_in += raw.nbytes
        self._account(raw.nbytes, +1)
        dropped = []
        while self.stats.bytes > self.budget:
            old, (_, nbytes) = self._entries.popitem(last=False)
            self._unlink(old)
            self._account(nbytes, -1)
            self.stats.evictions += 1
            dropped.append(old)
        return dropped

    def take(self, h: int) -> torch.Tensor | None:
        """Read an entry back and delete its file; None (a miss) if it is gone or fails its checksum."""
        entry = self._entries.pop(h, None)
        if entry is None:
            return None
        crc, nbytes = entry
        self._account(nbytes, -1)
        started = time.perf_counter()
        data = bytearray(nbytes)
        try:
            with open(self.path(h), "rb") as f:
                got = f.readinto(data)
        except OSError:
            got = -1
        self._unlink(h)
        self.stats.seconds_out += time.perf_counter() - started
        if got != nbytes or crc32c.crc32c(data) != crc:
            self.stats.checksum_mismatches += 1
            return None
        self.stats.bytes_out += nbytes
        return torch.frombuffer(data, dtype=torch.uint8).view(self.dtype).view(self.shape)

    def discard(self, h: int) -> None:
        """Delete an entry without reading it."""
        entry = self._entries.pop(h, None)
        if entry is not None:
            self._unlink(h)
            self._account(entry[1], -1)

    def hashes(self) -> list[int]:
        return list(self._entries)

    def clear(self) -> None:
        for h in list(self._entries):
            self._unlink(h)
        self._entries.clear()
        self.stats.blocks = self.stats.bytes = 0

    def close(self) -> None:
        self._entries.clear()
        self.stats.blocks = self.stats.bytes = 0
        self._finalizer()

    def _unlink(self, h: int) -> None:
        try:
            os.unlink(self.path(h))
        except FileNotFoundError:
            pass

    def _account(self, nbytes: int, sign: int) -> None:
        self.stats.blocks += sign
        self.stats.bytes += sign * nbytes


class KVTiers:
    """The tiers below one KV pool (host, then disk; either may be absent). See the module."""

    def __init__(self, kv: KVCache, host_bytes: int = 0, disk_dir: str | None = None, disk_bytes: int = 0):
        self.kv = kv
        self.block_bytes = kv.block_nbytes * kv.num_layers  # one block, every layer, K and V
        self.shape = kv.block_shape  # fp8: the rows carry their scales, so a block is whole as it is
        for flag, budget in (("kv_host_tier_bytes (--kv-host-tier-bytes)", host_bytes),
                             ("kv_disk_tier_bytes (--kv-disk-tier-bytes)", disk_bytes)):
            if budget < 0 or 0 < budget < self.block_bytes:
                raise ValueError(f"{flag} must be 0 (off) or at least one KV block ({self.block_bytes} bytes), "
                                 f"got {budget}")
        if (disk_dir is None) != (disk_bytes == 0):
            raise ValueError("the disk tier needs both a directory and a byte budget (--kv-disk-tier-dir and "
                             "--kv-disk-tier-bytes)")
        self.host = HostTier(host_bytes) if host_bytes else None
        self.disk = DiskTier(disk_dir, disk_bytes, self.shape, kv.dtype) if disk_dir else None
        self._pin = kv.device.type == "cuda"

    # ---- queries ---------------------------------------------------------------------------
    def tiers(self) -> list[HostTier | DiskTier]:
        return [t for t in (self.host, self.disk) if t is not None]

    def stats(self) -> dict[str, TierStats]:
        """Tier name -> its running totals (absent tiers are left out)."""
        return {t.name: t.stats for t in self.tiers()}

    def __contains__(self, h: int) -> bool:
        return any(h in t for t in self.tiers())

    def hashes(self) -> list[int]:
        return [h for t in self.tiers() for h in t.hashes()]

    # ---- moves (the BlockManager calls these on the engine thread) --------------------------
    def evict(self, h: int, block: int) -> list[int]:
        """Copy pool block ``block`` (hash ``h``) down; return the hashes no tier holds any more."""
        started = time.perf_counter()
        payload = torch.empty(self.shape, dtype=self.kv.dtype, pin_memory=self._pin)
        copy_block(payload, self.kv.tensor[:, block])
        elapsed = time.perf_counter() - started
        if self.host is None:
            return self.disk.put(h, payload) if self.disk is not None else [h]  # (KVTiers has one tier at least)
        self.host.stats.seconds_in += elapsed
        self.host.stats.bytes_in += payload.nbytes
        dropped = []
        for old, data in self.host.put(h, payload):
            self.host.stats.bytes_out += data.nbytes
            if self.disk is None:
                dropped.append(old)
            else:
                dropped += self.disk.put(old, data)
        return dropped

    def take(self, h: int) -> tuple[HostTier | DiskTier, torch.Tensor] | None:
        """Remove ``h`` from its tier and return (tier, payload); None if no tier holds it intact."""
        for tier in self.tiers():
            if h in tier:
                payload = tier.take(h)
                return None if payload is None else (tier, payload)
        return None

    def restore(self, block: int, taken: tuple[HostTier | DiskTier, torch.Tensor]) -> None:
        """Copy a taken payload into pool block ``block``: a hit of the tier it came from."""
        tier, payload = taken
        started = time.perf_counter()
        copy_block(self.kv.tensor[:, block], payload)
        tier.stats.seconds_out += time.perf_counter() - started
        if tier is self.host:
            tier.stats.bytes_out += payload.nbytes
        tier.stats.hits += 1

    def discard(self, h: int) -> None:
        """Forget a tier's copy of ``h`` (the pool computed the block again and holds it now)."""
        for tier in self.tiers():
            tier.discard(h)

    def clear(self) -> None:
        for tier in self.tiers():
            tier.clear()

    def close(self) -> None:
        self.clear()
        if self.disk is not None:
            self.disk.close()
