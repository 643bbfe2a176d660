"""DecodePicker: which decode gets the next request (pure logic, no I/O).

Two policies, both over the decodes whose latest load report is fresh, speaks our
protocol version, is not draining and has free KV blocks:

- ``wrr`` (default): smooth weighted round robin (the nginx algorithm) with weight = the
  decode's free KV bytes from its latest load report, over the decodes whose reported
  free blocks can hold the request (``blocks_needed``: prompt + max_tokens, what decode
  reserves). A decode with half the free memory of another gets a third of the
  requests; the sequence interleaves rather than sending bursts to one decode; a decode
  known to be too full for this request is not asked (no refusal round trip).
- ``rr``: plain round robin over the same set, blind to request size (the baseline).

Prefix preference (``wrr`` only, when ``pick`` is given ``overlap``: how many leading blocks of
the prompt each decode's prefix cache holds, from its KV events): when the eligible decodes
hold different amounts of the prompt, the pick is the decode with the highest

    prefix_weight * (blocks it holds / prompt blocks) + free KV bytes / the most free KV bytes

so a decode holding the conversation wins unless it has much less free memory than the
emptiest one (with weight 1: holding the whole prompt is worth all the free memory of the
emptiest decode). Ties go to the first address. A full decode is never eligible, prefix or
not. When every eligible decode holds the same amount (none, usually), plain ``wrr``.

A decode in a KV pool (``pdserve decode --kv-pool``) reports the blocks its peers could lend
it now and at most (``pool_free_blocks``, ``pool_total_blocks``): its free blocks and its whole
pool, as this picker sees them (``room``, ``capacity``), include them; a request bigger than
its own pool goes there pooled (greedy requests only: the decode refuses the others).

Load reports arrive from the LoadReportPoller (``update``); a report older than
``expiry_s`` no longer counts, so a decode that stopped answering drops out. Between
reports, ``note_allocation`` subtracts what a Session just took, so a burst of requests
within one polling interval does not all land on the decode that looked emptiest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from pdserve.protos.version import PROTOCOL_VERSION

POLICIES = ("wrr", "rr")


@dataclass(slots=True)
class DecodeLoad:
    """The part of a decode's LoadReport the picker needs."""

    free_blocks: int
    free_bytes: int
    total_blocks: int = 0  # the decode's whole pool; 0 = not reported
    protocol_version: int = PROTOCOL_VERSION
    draining: bool = False
    running: int = 0
    waiting: int = 0
    prefill_tokens_per_s: float = 0.0  # measured speed of prompts the decode computed itself; 0 = none yet
    pool_free_blocks: int = 0  # its KV pool's peers could lend it this many blocks now
    pool_total_blocks: int = 0  # ... and at most this many

    @property
    def room(self) -> int:
        """Free blocks for a request: its own plus what its pool could lend now."""
        return self.free_blocks + self.pool_free_blocks

    @property
    def capacity(self) -> int:
        """The largest request it can ever hold, in blocks (its pool's loans included); 0 = not reported."""
        return self.total_blocks + self.pool_total_blocks if self.total_blocks else 0

    def __post_init__(self) -> None:
        if self.free_blocks < 0 or self.free_bytes < 0:
            raise ValueError(f"free_blocks and free_bytes must be >= 0, got {self.free_blocks}, {self.free_bytes}")


@dataclass(slots=True)
class _Entry:
    load: DecodeLoad
    received_at: float
    received_round: int = 0
    current_weight: float = 0.0


@dataclass
class DecodePicker:
    policy: str = "wrr"
    expiry_s: float = 1.5
    protocol_version: int = PROTOCOL_VERSION
    clock: Callable[[], float] = time.monotonic
    # With a poller: a report is stale only after this many poll rounds started without a newer
    # one (and expiry_s passed). Rounds, not the wall clock alone, so that a prefill process
    # that was paused (SIGSTOP, a long GC or event-loop stall) does not find every report
    # stale at once on resuming, before its poller had a chance to ask again. 0: clock only.
    stale_rounds: int = 0
    prefix_weight: float = 1.0  # see "Prefix preference" above
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _rr_next: int = 0
    _rounds: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.expiry_s <= 0:
            raise ValueError(f"expiry_s must be > 0, got {self.expiry_s}")

    # -- fed by the poller / discovery -------------------------------------------------
    def round_started(self) -> None:
        """The poller started asking every decode again."""
        self._rounds += 1

    def update(self, address: str, load: DecodeLoad) -> None:
        entry = self._entries.get(address)
        if entry is None:
            self._entries[address] = _Entry(load, self.clock(), self._rounds)
        else:
            entry.load, entry.received_at, entry.received_round = load, self.clock(), self._rounds

    def _stale(self, entry: _Entry, now: float) -> bool:
        if now - entry.received_at <= self.expiry_s:
            return False
        return self.stale_rounds <= 0 or self._rounds - entry.received_round > self.stale_rounds

    def forget(self, address: str) -> None:
        """The decode left discovery: drop it and its state."""
        self._entries.pop(address, None)

    def note_allocation(self, address: str, blocks: int, nbytes: int) -> None:
        """A Session on ``address`` just allocated; lower its weight (and count one more waiting
        session there) until the next report. ``nbytes``: our estimate; the decode's own bytes per block
        (its free bytes over its free blocks: a tensor-parallel decode reports one rank's) when it has some."""
        entry = self._entries.get(address)
        if entry is not None:
            load = entry.load
            if load.free_blocks:
                nbytes = blocks * (load.free_bytes // load.free_blocks)
            load.free_blocks = max(0, load.free_blocks - blocks)
            load.free_bytes = max(0, load.free_bytes - nbytes)
            load.waiting += 1

    # -- queries ------------------------------------------------------------------------
    def _need(self, blocks_needed: int) -> int:
        """Free blocks a decode must report to be picked: only ``wrr`` looks at the request's size."""
        return max(1, blocks_needed) if self.policy == "wrr" else 1

    def _usable(self) -> dict[str, DecodeLoad]:
        """Decodes with a fresh report, our protocol version and not draining (full or not)."""
        now = self.clock()
        return {address: e.load for address, e in sorted(self._entries.items())
                if not self._stale(e, now) and e.load.protocol_version == self.protocol_version
                and not e.load.draining}

    def eligible(self, exclude: set[str] | frozenset[str] = frozenset(), blocks_needed: int = 0) -> list[str]:
        """Addresses a request needing ``blocks_needed`` KV blocks may go to now, in a stable order.

        Only ``wrr`` looks at ``blocks_needed``; ``rr`` stays size-blind.
        """
        need = self._need(blocks_needed)
        return [address for address, load in self._usable().items() if address not in exclude and load.room >= need]

    def usable(self) -> list[str]:
        """Decodes with a fresh report, our protocol version and not draining, full or not (a full
        one is a reason to wait in the admission queue, not to be unready)."""
        return list(self._usable())

    def all_full(self, blocks_needed: int = 0) -> bool:
        """No decode is eligible only because every fresh, compatible one is too full (busy, not broken)."""
        need = self._need(blocks_needed)
        # busy only if some decode could hold the request once others finish; a request larger
        # than every decode's whole pool will never fit (not worth waiting for)
        could_fit = [load for load in self._usable().values() if load.capacity == 0 or load.capacity >= need]
        return bool(could_fit) and all(load.room < need for load in could_fit)

    def never_fits(self, blocks_needed: int) -> int | None:
        """The largest whole pool among the fresh, compatible decodes when the request needs more
        than each of them holds in all (no wait helps; any policy), else None."""
        totals = [load.capacity for load in self._usable().values()]
        if totals and all(0 < total < blocks_needed for total in totals):
            return max(totals)
        return None
    def load(self, address: str) -> DecodeLoad | None:
        """The decode's latest load report (fresh or not), None if it never reported."""
        entry = self._entries.get(address)
        return None if entry is None else entry.load

    def reported_at(self, address: str) -> float | None:
        """When the decode's latest load report arrived (``clock()`` seconds), None if it never reported."""
        entry = self._entries.get(address)
        return None if entry is None else entry.received_at

    def known(self) -> list[str]:
        """Every decode with a report (fresh or not)."""
        return sorted(self._entries)

    def why_none(self, blocks_needed: int = 0) -> str:
        """A human reason why ``pick`` returned None (for 503 bodies and logs)."""
        if not self._entries:
            return "no decode server has reported load yet"
        now = self.clock()
        need = self._need(blocks_needed)
        parts = []
        for address in sorted(self._entries):
            entry = self._entries[address]
            load = entry.load
            if self._stale(entry, now):
                parts.append(f"{address}: load report stale ({now - entry.received_at:.1f}s old)")
            elif load.protocol_version != self.protocol_version:
                parts.append(f"{address}: protocol version {load.protocol_version} != ours {self.protocol_version}")
            elif load.draining:
                parts.append(f"{address}: draining")
            elif 0 < load.capacity < need:
                parts.append(f"{address}: holds only {load.capacity} KV blocks in all, {need} needed")
            elif load.room <= 0:
                parts.append(f"{address}: no free KV blocks")
            elif load.room < need:
                parts.append(f"{address}: {load.room} free KV blocks, {need} needed")
        return "; ".join(parts) or "no eligible decode server"

    def pick(self, exclude: set[str] | frozenset[str] = frozenset(), blocks_needed: int = 0,
             overlap: dict[str, int] | None = None, prompt_blocks: int = 0) -> str | None:
        """The decode for the next request (needing ``blocks_needed`` blocks on decode), or None.

        ``overlap``: address -> leading prompt blocks it holds (of ``prompt_blocks``), for the
        prefix preference (module docstring)."""
        candidates = self.eligible(exclude, blocks_needed)
        if not candidates:
            return None
        if self.policy == "wrr" and overlap and prompt_blocks > 0:
            held = {a: min(overlap.get(a, 0), prompt_blocks) for a in candidates}
            if len(set(held.values())) > 1:
                most_free = max(self._entries[a].load.free_bytes for a in candidates) or 1

                def score(address: str) -> float:
                    free = self._entries[address].load.free_bytes / most_free
                    return self.prefix_weight * held[address] / prompt_blocks + free

                return max(candidates, key=score)  # first of the best: candidates are sorted
        if self.policy == "rr":
            address = candidates[self._rr_next % len(candidates)]
            self._rr_next += 1
            return address
        total = 0.0
        best, best_weight = candidates[0], None
        for address in candidates:
            entry = self._entries[address]
            weight = float(entry.load.free_bytes)
            entry.current_weight += weight
            total += weight
            if best_weight is None or entry.current_weight > best_weight:
                best, best_weight = address, entry.current_weight
        self._entries[best].current_weight -= total
        return best
