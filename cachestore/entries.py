"""Receiver-side bookkeeping: pinned entries by request id, arrival per (layer, block), shared blocks.

Thread-safe (one lock) and free of sockets and asyncio, so tests drive it directly. The
receiver's socket threads call ``begin_receive``/``end_receive`` around each DATA frame; the
event loop calls ``expect``/``delete``/``fail`` and reads ``status``.

Lifetime by request id: an entry is pinned from ``expect`` until ``delete`` or failure.
Two live entries may name the same destination block only when both gave the same block
hash for it (the decode shares a prefix block); then the block is transferred once (for the
first entry, its *provider*) and counts as arrived for every owner. Deleting one owner never
releases a block another owner still pins. Any other overlap is refused (it would let one
request overwrite another's KV).

Bind tokens: ``expect`` draws a random token for each entry and returns it with the destination list
(``Destination.token``); the decode hands both to the prefill on the request's Session. ``bind`` and
``begin_receive`` refuse (``BindRefused``) a token that is not the entry's, before anything else is
checked or changed, so a peer that merely knows a live request id can neither bind it, nor write into
its blocks, nor fail it; ``bound_by`` says whether a connection bound an entry (only that connection
may CANCEL it).
"""

from __future__ import annotations

import hmac
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from .errors import BindRefused, ProtocolError, TransferError, UnknownRequestError
from .frames import TOKEN_BYTES
from .memory import KVLayout

TOMBSTONES = 4096  # remembered failures, so late waits get the reason, not "unknown request"


@dataclass(slots=True)
class _Block:
    hash: object
    provider: str
    owners: set[str] = field(default_factory=set)
    arrived: int = 0  # bit per layer


class Destination(list):
    """What ``expect`` returns: the destination block list for the sender (-1: already there), and
    ``token``, the bind token the sender must present with it (``CacheStoreSender.bind``)."""

    __slots__ = ("token",)

    def __init__(self, blocks, token: bytes):
        super().__init__(blocks)
        self.token = token


def _refused(rid: str, what: str) -> BindRefused:
    return BindRefused(f"{what} for request {rid!r} refused: its bind token is not the one this receiver issued "
                       "for it (only the prefill that holds the request's Session may send its KV)")


@dataclass(slots=True)
class Entry:
    rid: str
    blocks: list[int]
    counts: list[int]
    token: bytes = b""           # the bind token issued by expect (never logged)
    layers_done: int = 0
    conn: int | None = None      # the control connection that bound it (None before BIND)
    receiving: int = 0           # DATA frames currently being written into its blocks
    deleted: bool = False
    error: TransferError | None = None

    @property
    def complete(self) -> bool:
        return self.layers_done == len(self.counts)

    def layer_done(self, layer: int) -> bool:
        return self.counts[layer] == len(self.blocks)


class EntryTable:
    def __init__(self, layout: KVLayout):
        self.layout = layout
        self.lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._blocks: dict[int, _Block] = {}
        self._failed: OrderedDict[str, TransferError] = OrderedDict()
        self._incomplete = 0  # live entries still waiting for KV (the nixl thread polls only then)

    # ----- event loop side -------------------------------------------------------------
    def expect(self, rid: str, dst_blocks: Sequence[int], hashes: Sequence[object] | None = None) -> Destination:
        """Pin an entry; returns the dst list for the sender (-1 where a shared block is already provided)
        with the entry's new bind token."""
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request id must be a non-empty str, got {rid!r}")
        blocks = self.layout.check_blocks(dst_blocks, "destination block id")
        if not blocks:
            raise ValueError(f"request {rid!r}: expect() needs at least one destination block")
        if hashes is not None and len(hashes) != len(blocks):
            raise ValueError(f"request {rid!r}: {len(hashes)} block hashes for {len(blocks)} blocks")
        with self.lock:
            if rid in self._entries:
                raise ValueError(f"request {rid!r} is already expected (delete it first)")
            for i, b in enumerate(blocks):
                st = self._blocks.get(b)
                if st is not None and (hashes is None or st.hash is None or st.hash != hashes[i]):
                    raise ValueError(
                        f"request {rid!r}: destination block {b} is pinned by live request(s) {sorted(st.owners)}; "
                        "two live requests may share a block only with equal block hashes")
            entry = Entry(rid, blocks, [0] * self.layout.num_layers, secrets.token_bytes(TOKEN_BYTES))
            for_sender: list[int] = []
            for i, b in enumerate(blocks):
                st = self._blocks.get(b)
                if st is None:
                    st = self._blocks[b] = _Block(None if hashes is None else hashes[i], rid)
                    for_sender.append(b)
                else:
                    for_sender.append(-1)
                st.owners.add(rid)
                for layer in range(self.layout.num_layers):
                    if st.arrived >> layer & 1:
                        entry.counts[layer] += 1
            entry.layers_done = sum(entry.layer_done(l) for l in range(self.layout.num_layers))
            self._entries[rid] = entry
            self._incomplete += not entry.complete
            self._failed.pop(rid, None)
            return Destination(for_sender, entry.token)

    def status(self, rid: str) -> Entry:
        """The live entry, or raise its failure (TransferError) / UnknownRequestError."""
        with self.lock:
            entry = self._entries.get(rid)
            if entry is not None and not entry.deleted:
                if entry.error is not None:
                    raise entry.error
                return entry
            if rid in self._failed:
                raise self._failed[rid]
        raise UnknownRequestError(f"no CacheStore entry for request {rid!r} (never expected, or already deleted)")

    def delete(self, rid: str) -> tuple[Entry | None, list[Entry]]:
        """Unpin (idempotent). Returns (the entry if it was still receiving, other entries failed with it).

        The first tells the receiver to warn the sender; the second are owners of shared
        blocks this entry was still providing.
        """
        with self.lock:
            self._failed.pop(rid, None)
            entry = self._entries.get(rid)
            if entry is None or entry.deleted:
                return None, []
            entry.deleted = True
            if entry.error is not None:  # failed earlier, already released; only a frame still writes
                return None, []
            unfinished = entry.error is None and not entry.complete
            failed: list[Entry] = []
            for other in self._release_locked(entry):
                failed += self._fail_locked(other, TransferError(
                    f"request {other!r}: a shared KV block it needed was being sent for request {rid!r}, "
                    "which was deleted before it arrived"))
            return (entry if unfinished else None), failed

    def fail(self, rid: str, error: TransferError) -> list[Entry]:
        """Fail and unpin rid (and owners of shared blocks it was still providing). Returns those failed."""
        with self.lock:
            return self._fail_locked(rid, error)

    def fail_connection(self, conn: int, error_text: str) -> list[Entry]:
        with self.lock:
            failed: list[Entry] = []
            for entry in [e for e in self._entries.values() if e.conn == conn and not e.deleted and not e.complete]:
                failed += self._fail_locked(entry.rid, TransferError(f"request {entry.rid!r}: {error_text}"))
            return failed

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def incomplete(self) -> int:
        """Live entries whose KV has not all arrived (read without the lock: a hint for pollers)."""
        return self._incomplete

    def live_ids(self) -> list[str]:
        with self.lock:
            return [rid for rid, e in self._entries.items() if not e.deleted]

    def bind(self, rid: str, conn: int, token: bytes) -> None:
        """Connection ``conn`` carries rid from now on (its CANCEL and its closing reach the entry);
        BindRefused for a wrong token, UnknownRequestError for no live entry."""
        with self.lock:
            entry = self._entries.get(rid)
            if entry is None or entry.deleted or entry.error is not None:
                raise UnknownRequestError(f"receiver has no entry for request {rid!r} (never "
                                          f"expected, deleted or failed)")
            if not hmac.compare_digest(token, entry.token):
                raise _refused(rid, "BIND")
            entry.conn = conn

    def bound_by(self, rid: str, conn: int) -> bool:
        """True when connection ``conn`` bound rid (with its token) and the entry is live."""
        with self.lock:
            entry = self._entries.get(rid)
            return entry is not None and not entry.deleted and entry.conn == conn

    def stats(self) -> dict:
        with self.lock:
            live = list(self._entries.values())
            return {
                "pinned_entries": len(live),
                "inflight_transfers": sum(1 for e in live if e.conn is not None and not e.complete and not e.deleted),
                "pinned_blocks": len(self._blocks),
                "receiving_frames": sum(e.receiving for e in live),
            }

    # ----- socket thread side ----------------------------------------------------------
    def begin_receive(self, rid: str, layer: int, block: int, nblocks: int, token: bytes) -> Entry:
        """Check a DATA frame (or NIXL notification) may land; pins the entry until end_receive. Raises
        without pinning: UnknownRequestError, BindRefused (``token`` is not the entry's: nothing else
        is checked, the entry is untouched), ProtocolError (layer or blocks not the entry's).

        The returned entry's ``deleted``/``error`` may be read without the lock while the
        bytes arrive, to stop writing into blocks that were released meanwhile.
        """
        with self.lock:
            entry = self._entries.get(rid)
            if entry is None or entry.deleted or entry.error is not None:
                exc = UnknownRequestError(f"DATA for request {rid!r}, which the receiver does not expect (never "
                                          f"expected, deleted or failed)")
                # why it failed, if it did (a failed entry may be gone already: its tombstone says)
                exc.cause = self._failed.get(rid) if entry is None or entry.deleted else entry.error
                raise exc
            if not hmac.compare_digest(token, entry.token):
                raise _refused(rid, "KV")
            if not 0 <= layer < self.layout.num_layers or nblocks <= 0:
                raise ProtocolError(f"DATA for request {rid!r}: layer {layer} / {nblocks} blocks out of range")
            for b in range(block, block + nblocks):
                st = self._blocks.get(b)
                if st is None or rid not in st.owners:
                    raise ProtocolError(f"DATA for request {rid!r} targets block {b}, which is not allocated to it")
            entry.receiving += 1
            return entry

    def busy(self, rid: str) -> bool:
        """True while a frame may still write into rid's blocks (even after delete or failure)."""
        with self.lock:
            entry = self._entries.get(rid)
            return entry is not None and entry.receiving > 0

    def end_receive(self, rid: str, layer: int, block: int, nblocks: int, ok: bool) -> set[str]:
        """The frame's bytes landed (ok) or not; returns the request ids that completed a layer."""
        touched: set[str] = set()
        with self.lock:
            entry = self._entries[rid]
            entry.receiving -= 1
            if ok and not entry.deleted and entry.error is None:
                for b in range(block, block + nblocks):
                    st = self._blocks[b]
                    if st.arrived >> layer & 1:
                        continue
                    st.arrived |= 1 << layer
                    for owner in st.owners:
                        e = self._entries[owner]
                        e.counts[layer] += 1
                        if e.layer_done(layer):
                            e.layers_done += 1
                            self._incomplete -= e.complete
                            touched.add(owner)
            if entry.receiving == 0 and (entry.deleted or entry.error is not None):
                del self._entries[rid]
        return touched

    # ----- internals -------------------------------------------------------------------
    def _fail_locked(self, rid: str, error: TransferError) -> list[Entry]:
        entry = self._entries.get(rid)
        if entry is None or entry.deleted or entry.error is not None:
            return []
        entry.error = error
        self._failed[rid] = error
        while len(self._failed) > TOMBSTONES:
            self._failed.popitem(last=False)
        failed = [entry]
        for other in self._release_locked(entry):
            failed += self._fail_locked(other, TransferError(
                f"request {other!r}: a shared KV block it needed was being sent for request "
                f"{rid!r}, which failed: {error}"))
        return failed

    def _release_locked(self, entry: Entry) -> set[str]:
        """Drop entry from its blocks; returns owners left waiting on blocks it was providing."""
        orphans: set[str] = set()
        self._incomplete -= not entry.complete
        full = (1 << self.layout.num_layers) - 1
        for b in entry.blocks:
            st = self._blocks[b]
            st.owners.discard(entry.rid)
            if not st.owners:
                del self._blocks[b]
            elif st.provider == entry.rid:
                if st.arrived != full:
                    orphans |= st.owners
                st.provider = next(iter(st.owners))
        if entry.receiving == 0:
            del self._entries[entry.rid]
        return orphans
