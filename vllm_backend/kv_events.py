"""VllmKvEvents: vLLM's prefix-cache events, re-hashed the way pdserve's routers and pickers hash
prompts, told to the server's ``KvEventPublisher`` (``pdserve/kv_events.py``).

Lifecycle of one event (everything on the engine thread):

1. vLLM's block pool records ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` while the
   scheduler allocates, caches and evicts (``enable_kv_cache_events``); at the end of each step
   the scheduler hands the batch to its ``kv_event_publisher``, which is this object (set by
   ``VllmAsyncEngine.publish_kv_events`` in place of vLLM's null publisher).
2. ``BlockStored`` carries vLLM's hashes, the parent's hash and the blocks' token ids. vLLM's
   hashes are not pdserve's, so each full block is re-hashed with ``engine.block_manager
   .block_hash`` chained from the parent's pdserve hash (kept here per vLLM hash): the same value
   a router computes from the prompt's token ids.
3. vLLM may cache several blocks under one hash (two requests computed the same prefix at once):
   a vLLM hash counts its stored blocks, and pdserve hears ``removed`` only when the last goes.

Left out, so never claimed as a hit: partial blocks (vLLM's partial prefix entries), blocks with
extra hash keys (LoRA, multimodal, cache salt), other KV-cache groups, and a block whose parent
this object never heard of. Fewer hits are safe; a wrong hit is not.
"""

from __future__ import annotations

from pdserve.engine.block_manager import PrefixCacheListener, block_hash


class VllmKvEvents:
    """vLLM's ``EventPublisher`` interface (``publish``, ``shutdown``) over a PrefixCacheListener."""

    def __init__(self, listener: PrefixCacheListener, block_size: int):
        self.listener, self.block_size = listener, block_size
        self._ours: dict[object, tuple[int, int]] = {}  # vLLM hash -> (pdserve hash, blocks vLLM caches under it)
        self.skipped = 0  # BlockStored events left out (see the module docstring)

    def publish(self, batch) -> None:
        for event in batch.events:
            kind = type(event).__name__
            if kind == "BlockStored":
                self._stored(event)
            elif kind == "BlockRemoved":
                self._removed(event)
            elif kind == "AllBlocksCleared":
                self._ours.clear()
                self.listener.cleared()

    def shutdown(self) -> None:
        pass

    def held(self) -> int:
        """Distinct full blocks this object tells pdserve are cached."""
        return len(self._ours)

    def _plain(self, event) -> bool:
        """A full-block store of the one KV-cache group with nothing but token ids in its hashes."""
        bs, n = self.block_size, len(event.block_hashes)
        return (event.block_size == bs and len(event.token_ids) == n * bs and not getattr(event, "lora_name", None)
                and getattr(event, "lora_id", None) is None and getattr(event, "group_idx", None) in (None, 0)
                and not any(getattr(event, "extra_keys", None) or ()))

    def _stored(self, event) -> None:
        parent = None
        if event.parent_block_hash is not None:
            known = self._ours.get(event.parent_block_hash)
            parent = known[0] if known is not None else None
        if not self._plain(event) or (event.parent_block_hash is not None and parent is None):
            self.skipped += 1
            return
        bs, new = self.block_size, []
        for i, theirs in enumerate(event.block_hashes):
            known = self._ours.get(theirs)
            if known is None:
                parent = block_hash(parent, event.token_ids[i * bs:(i + 1) * bs])
                self._ours[theirs] = (parent, 1)
                new.append(parent)
            else:
                parent = known[0]
                self._ours[theirs] = (parent, known[1] + 1)
        if new:
            self.listener.stored(new)

    def _removed(self, event) -> None:
        gone = []
        for theirs in event.block_hashes:
            known = self._ours.get(theirs)
            if known is None:
                continue  # a block left out when stored (or a partial one)
            if known[1] > 1:
                self._ours[theirs] = (known[0], known[1] - 1)
            else:
                del self._ours[theirs]
                gone.append(known[0])
        if gone:
            self.listener.removed(gone)
