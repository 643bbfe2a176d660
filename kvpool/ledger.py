"""DebtLedger: the gManager's global debt ledger (pure Python, no I/O).

One row per live rManager: its address, free and lendable blocks, and what it lent, per
borrower. The lender owns its row: every report replaces the whole row, so a restarted
gManager has the full ledger back after one round of reports (no state of its own to lose).
A row not refreshed within ``ttl_s`` belongs to a dead instance and is dropped, with every
debt in it; debts *to* a dead borrower are dropped by its lenders (they free those loans when
the borrower leaves ``live()``) and leave the ledger with their next report.

``candidates`` answers "who has room": live instances other than the borrower with lendable
blocks, most lendable first, at most three (the paper's gManager suggests three creditors;
the borrower asks each in turn and the lender itself decides, first come first served).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Row:
    address: str
    free_blocks: int
    lendable_blocks: int
    lent: dict[str, int] = field(default_factory=dict)  # borrower -> blocks
    seen_at: float = 0.0
    max_lendable: int = 0  # the most it ever lends (its pool minus its reserve)


class DebtLedger:
    def __init__(self, ttl_s: float):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self.rows: dict[str, Row] = {}

    def report(self, instance: str, address: str, free_blocks: int, lendable_blocks: int,
               lent: dict[str, int], now: float, max_lendable: int = 0) -> None:
        """Replace the instance's row with what it reports now."""
        if not instance:
            raise ValueError("a report needs an instance id")
        if free_blocks < 0 or lendable_blocks < 0 or lendable_blocks > free_blocks:
            raise ValueError(f"instance {instance!r} reported free {free_blocks}, lendable {lendable_blocks}: "
                             "need 0 <= lendable <= free")
        bad = {b: n for b, n in lent.items() if n <= 0 or b == instance}
        if bad:
            raise ValueError(f"instance {instance!r} reported impossible debts {bad} (blocks must be > 0, "
                             "and an instance cannot lend to itself)")
        self.rows[instance] = Row(address, free_blocks, lendable_blocks, dict(lent), now,
                                  max(max_lendable, lendable_blocks))

    def expire(self, now: float) -> list[str]:
        """Drop the rows of instances silent for longer than ttl_s; their ids."""
        dead = [i for i, r in self.rows.items() if now - r.seen_at > self.ttl_s]
        for instance in dead:
            del self.rows[instance]
        return dead

    def live(self) -> list[str]:
        return sorted(self.rows)

    def candidates(self, borrower: str, blocks: int, exclude: set[str] = frozenset(),
                   limit: int = 3) -> list[tuple[str, str, int]]:
        """(instance, address, lendable) of up to ``limit`` lenders, most lendable first."""
        if blocks <= 0:
            raise ValueError(f"blocks must be positive, got {blocks}")
        found = [(i, r.address, r.lendable_blocks) for i, r in self.rows.items()
                 if i != borrower and i not in exclude and r.lendable_blocks > 0]
        found.sort(key=lambda c: (-c[2], c[0]))
        return found[:limit]

    def debts(self) -> dict[tuple[str, str], int]:
        """(lender, borrower) -> blocks, every debt in the ledger."""
        return {(lender, b): n for lender, r in self.rows.items() for b, n in r.lent.items()}

    def total_lent(self) -> int:
        return sum(self.debts().values())

    def owed_by(self, borrower: str) -> int:
        return sum(n for (_, b), n in self.debts().items() if b == borrower)
