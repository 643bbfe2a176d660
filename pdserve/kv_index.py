"""PrefixIndex: which prompt blocks each server holds, kept from its KV events. Pure: no I/O.

Used by the router (one view per prefill) and by each prefill (one view per decode, for the
decode picker); ``pdserve/kv_follow.py`` feeds it from a server's Subscribe stream.

The protocol (``protos/kv_events.proto``): a server's stream starts with a snapshot
(epoch, seq, every hash), then events numbered seq+1, seq+2, ... of the same epoch.
The index trusts a server's hashes only while that chain is unbroken:

- ``apply_snapshot`` replaces the server's hashes and says why it synced: ``initial`` (first
  time), ``epoch`` (the server restarted: its epoch changed), ``resync`` (same epoch again,
  after a gap or a broken stream).
- ``apply_event`` returns ``applied``; or ``duplicate`` (seq already applied: ignored); or
  ``gap`` (seq is not last+1), ``epoch`` (another epoch), ``unsynced`` (no snapshot yet): for
  these three the server's hashes are forgotten at once and the caller must resubscribe.
- ``forget`` (the stream broke) forgets the hashes but remembers the epoch, so that the next
  snapshot tells a restart from a reconnect; ``remove`` (gone from discovery) drops the server.

Two routers that applied the same events hold the same index (nothing here depends on time
or arrival order across servers), so ``choice.choose`` gives them the same answer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
RESYNC_VERDICTS = ("gap", "epoch", "unsynced")


@dataclass(slots=True)
class ServerView:
    """What the index knows of one server."""

    epoch: str = ""
    seq: int = 0
    block_size: int = 0
    synced: bool = False
    hashes: set[int] = field(default_factory=set)


class PrefixIndex:
    def __init__(self) -> None:
        self._views: dict[str, ServerView] = {}

    # ---- the protocol ---------------------------------------------------------------------
    def apply_snapshot(self, server: str, epoch: str, seq: int, hashes, block_size: int) -> str:
        view = self._views.get(server)
        if view is None:
            reason, view = "initial", self._views.setdefault(server, ServerView())
        else:
            reason = "epoch" if view.epoch and view.epoch != epoch else "resync"
        view.epoch, view.seq, view.block_size, view.synced = epoch, seq, block_size, True
        view.hashes = set(hashes)
        return reason

    def apply_event(self, server: str, epoch: str, seq: int, kind: str, hashes) -> str:
        view = self._views.get(server)
        if view is None or not view.synced:
            return self._distrust(server, "unsynced")
        if epoch != view.epoch:
            return self._distrust(server, "epoch")
        if seq <= view.seq:
            return "duplicate"
        if seq != view.seq + 1:
            return self._distrust(server, "gap")
        if kind == STORED:
            view.hashes.update(hashes)
        elif kind == REMOVED:
            view.hashes.difference_update(hashes)
        elif kind == CLEARED:
            view.hashes.clear()
        else:
            raise ValueError(f"unknown KV event kind {kind!r}")
        view.seq = seq
        return "applied"

    def forget(self, server: str) -> None:
        """The server's stream broke: its hashes are no longer known (its epoch is kept)."""
        view = self._views.get(server)
        if view is not None:
            view.synced, view.hashes = False, set()

    def remove(self, server: str) -> None:
        """The server left discovery: nothing of it stays."""
        self._views.pop(server, None)

    def _distrust(self, server: str, verdict: str) -> str:
        self.forget(server)
        return verdict

    # ---- queries --------------------------------------------------------------------------
    def servers(self) -> list[str]:
        return sorted(self._views)

    def view(self, server: str) -> ServerView | None:
        return self._views.get(server)

    def overlap(self, server: str, prompt_hashes: Iterable[int]) -> int:
        """Leading blocks of the prompt (its chained hashes, in order) the server holds; 0 unless synced.
        Read only up to the first block it lacks (the router's hashes are computed as far as that)."""
        view = self._views.get(server)
        if view is None or not view.synced:
            return 0
        n = 0
        for h in prompt_hashes:
            if h not in view.hashes:
                break
            n += 1
        return n
