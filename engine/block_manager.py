"""BlockManager: which KV blocks are free, who holds which, and prefix reuse by block hash.

Pure Python (no torch), so unit tests drive it directly.

Contracts
- A block is *held* while its reference count is > 0. ``allocate`` / ``append_slots``
  take references, ``free`` drops them. Whoever allocated a block table frees it exactly once.
- A *full* block (``block_size`` tokens) gets a hash chained over token ids: the hash of block
  i covers block i-1's hash and block i's token ids, so equal hashes mean equal prefixes.
  ``register_full_blocks`` records the hashes of blocks whose KV has been written.
- When a hashed block's last reference is dropped it goes to an LRU of cached free blocks:
  still counted as free, but a later request whose prompt starts with the same tokens reuses
  it (reference count back to 1) instead of recomputing it. Fresh allocations take never-
  hashed blocks first, then evict the least recently freed cached block.
- Allocation is all-or-nothing: when the blocks cannot be had, ``OutOfBlocksError`` is raised
  and nothing changed.
- ``listener`` (optional, a PrefixCacheListener) hears every change of the set of hashes the
  cache can match (``prefix_hashes()``): ``stored`` when a hash is recorded, ``removed`` when
  its block is evicted (once per allocation, with every block it evicted: one KV event, not one
  per block), ``cleared`` by ``clear_prefix_cache``. It is called on the thread that
  calls the BlockManager (the engine thread), in order, and must not call back into it.
- ``tiers`` (optional, a LowerTiers: ``engine/kv_tiers.py``) catches evicted cached blocks:
  their KV is copied down (host memory, then disk) instead of lost, and a prompt whose chained
  hashes continue past the pool's blocks into a tier gets those blocks copied back into fresh
  pool blocks (counted as cached tokens, like pool hits). A block in a lower tier is still a
  prefix hit for this server, so the listener hears ``removed`` only when a hash leaves the
  last tier (or fails its checksum on the way back), not when it leaves the pool, and nothing
  when it moves between the pool and a tier: ``prefix_hashes()`` = pool hashes + tier hashes.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from typing import Any, Protocol, TypeVar

from .errors import OutOfBlocksError


def block_hash(parent: int | None, token_ids: list[int] | tuple[int, ...]) -> int:
    """Hash of one full block: covers the parent block's hash and this block's token ids.

    Deterministic across processes (blake2b, not Python's salted ``hash``), so a prefill and a
    decode process compute the same value for the same prefix.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<q", -1 if parent is None else parent))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return struct.unpack("<q", h.digest())[0]


def chained_hashes(token_ids: list[int], block_size: int, parent: int | None = None) -> list[int]:
    """Hashes of every full block of ``token_ids`` (a trailing partial block has none): ``block_hash`` of each,
    chained, with the ids packed once (the router hashes every prompt: its bytes per block are the same)."""
    num_full = len(token_ids) // block_size if block_size > 0 else 0
    if num_full == 0:
        return []
    data = memoryview(struct.pack(f"<{num_full * block_size}q", *token_ids[: num_full * block_size]))
    step = 8 * block_size
    out = []
    for start in range(0, num_full * step, step):
        h = hashlib.blake2b(struct.pack("<q", -1 if parent is None else parent), digest_size=8)
        h.update(data[start : start + step])
        parent = struct.unpack("<q", h.digest())[0]
        out.append(parent)
    return out


class LazyReusableHashes:
    """``reusable_hashes(token_ids, block_size)``, each block hashed only when a reader first reaches it.

    A lookup walks a prompt's hashes until the first block a server lacks, so a router that asks every
    prefill needs the hashes only up to the longest prefix any of them holds, plus one: for most prompts a
    few of their blocks (a 12k-token prompt has 187; hashing them all took 0.45 ms of the router's CPU).
    Iterating gives the same values as ``reusable_hashes`` (``block_hash`` chained); ``computed`` says how
    many blocks were hashed so far.
    """

    __slots__ = ("_ids", "_block_size", "_blocks", "_hashes", "_pack")

    def __init__(self, token_ids: list[int], block_size: int):
        self._ids, self._block_size = token_ids, block_size
        self._blocks = reusable_blocks(len(token_ids), block_size) if block_size > 0 else 0
        self._hashes: list[int] = []
        self._pack = struct.Struct(f"<{block_size}q").pack if self._blocks else None

    def __len__(self) -> int:
        return self._blocks

    @property
    def computed(self) -> int:
        return len(self._hashes)

    def _next(self) -> int:
        i, bs, done = len(self._hashes), self._block_size, self._hashes
        h = hashlib.blake2b(struct.pack("<q", done[-1] if done else -1), digest_size=8)
        h.update(self._pack(*self._ids[i * bs:(i + 1) * bs]))  # type: ignore[misc]
        value = struct.unpack("<q", h.digest())[0]
        done.append(value)
        return value

    def __iter__(self):
        done = self._hashes
        i = 0
        while i < self._blocks:
            yield done[i] if i < len(done) else self._next()
            i += 1


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: ceil(num_tokens / block_size). The one place for it."""
    return -(-num_tokens // block_size)


def reusable_blocks(num_tokens: int, block_size: int) -> int:
    """Leading full blocks of a prompt of ``num_tokens`` that a cache may supply: never the block of
    its last token, which is always computed (its logits give the first output token). The one place
    for the rule; every prefix cache, router and index that predicts a hit uses it."""
    return max(0, num_tokens - 1) // block_size


def reusable_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Chained hashes of the ``reusable_blocks`` of a prompt (what a prefix-cache lookup may match)."""
    return chained_hashes(token_ids[: reusable_blocks(len(token_ids), block_size) * block_size], block_size)


class PrefixCacheListener(Protocol):
    """Hears changes of the prefix cache's hash set (KV events); see the module docstring."""

    def stored(self, hashes: list[int]) -> None: ...

    def removed(self, hashes: list[int]) -> None: ...

    def cleared(self) -> None: ...


Payload = TypeVar("Payload")  # what a tier hands back for a block (KVTiers: its tier and the block's tensor)


class LowerTiers(Protocol[Payload]):
    """Where evicted cached blocks go (``engine/kv_tiers.py``: KVTiers); see the module docstring."""

    def __contains__(self, h: int) -> bool: ...

    def evict(self, h: int, block: int) -> list[int]: ...  # copy down; the hashes no tier holds any more

    def take(self, h: int) -> Payload | None: ...  # out of its tier (None: lost or corrupt, a miss)

    def restore(self, block: int, taken: Payload) -> None: ...  # copy a taken block into the pool

    def discard(self, h: int) -> None: ...

    def hashes(self) -> list[int]: ...

    def clear(self) -> None: ...


class BlockManager:
    """Reference-counted KV blocks ``0 .. num_blocks-1`` with a prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # free, no hash
        self._cached: OrderedDict[int, int] = OrderedDict()  # hash -> block id, free but reusable (LRU order)
        self._by_hash: dict[int, int] = {}  # hash -> block id, held or cached
        self.prefix_hits = 0  # blocks reused, for metrics and tests
        self.listener: PrefixCacheListener | None = None
        self.tiers: LowerTiers[Any] | None = None

    # ---- queries -------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        """Blocks that an allocation can take (never-used plus cached-but-unreferenced)."""
        return len(self._free) + len(self._cached)

    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def prefix_hashes(self) -> list[int]:
        """Every hash the prefix cache can match now (held or cached free blocks, and lower tiers)."""
        return list(self._by_hash) + (self.tiers.hashes() if self.tiers is not None else [])

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Block ids holding the longest cached prefix of ``token_ids`` in the pool.

        At most ``reusable_blocks(len(token_ids), block_size)``: the last prompt token is always
        computed, because its logits give the first generated token.
        """
        return self._match(token_ids)[0]

    def _match(self, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """(pool block ids of the longest cached prefix, the hashes that continue it in lower tiers)."""
        if not self.enable_prefix_cache:
            return [], []
        hits: list[int] = []
        lower: list[int] = []
        for h in reusable_hashes(token_ids, self.block_size):
            block = None if lower else self._by_hash.get(h)
            if block is not None:
                hits.append(block)
            elif self.tiers is not None and h in self.tiers:
                lower.append(h)
            else:
                break
        return hits, lower

    # ---- allocation ----------------------------------------------------------------------
    def allocate(self, token_ids: list[int], num_tokens: int, use_prefix_cache: bool = True) -> tuple[list[int], int]:
        """A block table with room for ``num_tokens`` tokens whose first tokens are ``token_ids``.

        Returns ``(block_ids, num_cached_tokens)``: the first ``num_cached_tokens`` tokens'
        KV is already in the reused blocks. Raises OutOfBlocksError (changing nothing) when
        the free blocks do not suffice.
        """
        hits, lower = self._match(token_ids) if use_prefix_cache else ([], [])
        total = blocks_needed(num_tokens, self.block_size)
        fresh = total - len(hits)
        hits_from_cache = sum(1 for b in hits if self._ref[b] == 0)
        available = self.num_free_blocks() - hits_from_cache
        if fresh > available:
            raise OutOfBlocksError(
                f"need {fresh} free KV blocks ({num_tokens} tokens, {len(hits)} blocks reused from the prefix cache) "
                f"but only {available} are free of {self.num_blocks}"
            )
        for b in hits:
            self._take_ref(b)
        taken = self._take_lower(lower)  # before _pop_fresh: its evictions may push tier entries out
        table = hits + self._pop_fresh_many(fresh)
        for (h, payload), b in zip(taken, table[len(hits):]):
            self._lower().restore(b, payload)
            self._hash[b] = h
            self._by_hash[h] = b
        reused = len(hits) + len(taken)
        self.prefix_hits += reused
        return table, reused * self.block_size

    def _lower(self) -> LowerTiers[Any]:
        """The lower tiers (a hash continues a prefix there only when there are some: ``_match``)."""
        if self.tiers is None:
            raise RuntimeError("the block manager has no lower KV tiers")
        return self.tiers

    def _take_lower(self, lower: list[int]) -> list[tuple[int, object]]:
        """Take the tier entries that continue a prefix, up to the first one lost (a miss from there)."""
        taken: list[tuple[int, object]] = []
        for h in lower:
            payload = self._lower().take(h)
            if payload is None:
                if self.listener is not None:
                    self.listener.removed([h])
                break
            taken.append((h, payload))
        return taken

    def append_slots(self, block_table: list[int], num_tokens: int) -> None:
        """Grow ``block_table`` in place so that it holds ``num_tokens`` tokens."""
        extra = blocks_needed(num_tokens, self.block_size) - len(block_table)
        if extra <= 0:
            return
        if extra > self.num_free_blocks():
            raise OutOfBlocksError(f"need {extra} more KV blocks but only {self.num_free_blocks()} are free")
        block_table.extend(self._pop_fresh_many(extra))

    def register_full_blocks(self, block_table: list[int], hashes: list[int], num_tokens: int,
                             token_ids: list[int]) -> None:
        """Record hashes of blocks that became full now that ``num_tokens`` tokens' KV is written.

        ``hashes`` is the caller's list of hashes of its already-registered full blocks; it
        is extended in place (so each block is hashed once over a request's life).
        """
        if not self.enable_prefix_cache:
            return
        num_full = min(num_tokens // self.block_size, len(block_table))
        stored = []
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            h = block_hash(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            hashes.append(h)
            block = block_table[i]
            if self._hash[block] is None and h not in self._by_hash:
                self._hash[block] = h
                self._by_hash[h] = block
                if self.tiers is not None and h in self.tiers:
                    self.tiers.discard(h)  # computed again: the pool's copy replaces the tier's (no event)
                else:
                    stored.append(h)
        if stored and self.listener is not None:
            self.listener.stored(stored)

    def free(self, block_table: list[int]) -> None:
        """Drop one reference to each block (in reverse, so a prefix's tail is evicted first)."""
        for b in reversed(block_table):
            if self._ref[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than allocated")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                h = self._hash[b]
                if h is not None and self._by_hash.get(h) == b:
                    self._cached[h] = b  # newest at the end; eviction takes the oldest
                else:
                    self._hash[b] = None
                    self._free.append(b)

    def clear_prefix_cache(self) -> None:
        """Forget every hash: cached free blocks become plain free blocks, held blocks are no
        longer matched (they are still freed normally)."""
        if not self.enable_prefix_cache:
            return
        self._free.extend(self._cached.values())
        self._cached.clear()
        self._by_hash.clear()
        self._hash = [None] * self.num_blocks
        if self.tiers is not None:
            self.tiers.clear()
        if self.listener is not None:
            self.listener.cleared()

    # ---- internals -----------------------------------------------------------------------
    def _take_ref(self, block: int) -> None:
        if self._ref[block] == 0:
            h = self._hash[block]
            if h is not None:
                self._cached.pop(h, None)
        self._ref[block] += 1

    def _pop_fresh_many(self, n: int) -> list[int]:
        """``n`` fresh blocks; the hashes their evictions took from the cache go to the listener in one call."""
        gone: list[int] = []
        blocks = [self._pop_fresh(gone) for _ in range(n)]
        if gone and self.listener is not None:
            self.listener.removed(gone)
        return blocks

    def _pop_fresh(self, gone: list[int]) -> int:
        """A fresh block (a free one, else the least recently freed cached one, evicted: its hash, or what
        the tiers let go, is appended to ``gone``)."""
        if self._free:
            block = self._free.popleft()
        else:
            h, block = self._cached.popitem(last=False)  # least recently freed
            del self._by_hash[h]
            self._hash[block] = None
            gone += [h] if self.tiers is None else self.tiers.evict(h, block)
        self._ref[block] = 1
        return block
