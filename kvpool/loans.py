"""LoanBook: one rManager's record of the blocks it lent (pure Python, no I/O, no torch).

A loan is (request id, borrower, block ids, tokens written). Lending is bounded: the rManager
keeps ``reserve`` blocks free for its own requests, so ``lendable = max(0, free - reserve)``.
A loan ends (its blocks go back to the pool) when the borrower releases the request (it
finished or failed), when the borrower is no longer live in the gManager's view, or when the
loan was idle (no put or attend) for ``idle_s``; ``lent()`` is the ledger row reported.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Loan:
    request_id: str
    borrower: str
    block_ids: list[int]
    tokens: int = 0            # tokens written so far (the prefix of the loan's slots in use)
    used_at: float = 0.0


class LoanBook:
    def __init__(self, reserve: int, idle_s: float):
        if reserve < 0:
            raise ValueError(f"reserve must be >= 0, got {reserve}")
        self.reserve, self.idle_s = reserve, idle_s
        self.loans: dict[str, Loan] = {}

    def lendable(self, free_blocks: int) -> int:
        return max(0, free_blocks - self.reserve)

    def grant(self, want: int, free_blocks: int) -> int:
        """How many of ``want`` blocks may be lent now."""
        return min(want, self.lendable(free_blocks))

    def add(self, loan: Loan) -> None:
        if loan.request_id in self.loans:
            raise ValueError(f"request {loan.request_id!r} already holds a loan here")
        self.loans[loan.request_id] = loan

    def pop(self, request_id: str) -> Loan | None:
        return self.loans.pop(request_id, None)

    def get(self, request_id: str) -> Loan:
        loan = self.loans.get(request_id)
        if loan is None:
            raise KeyError(f"no loan for request {request_id!r} here (released, expired, or never lent)")
        return loan

    def stale(self, live: set[str] | None, now: float) -> list[str]:
        """Request ids whose borrower left the live set, or idle longer than idle_s."""
        return [rid for rid, loan in self.loans.items()
                if (live is not None and loan.borrower not in live) or now - loan.used_at > self.idle_s]

    def lent(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for loan in self.loans.values():
            out[loan.borrower] = out.get(loan.borrower, 0) + len(loan.block_ids)
        return out

    def lent_blocks(self) -> int:
        return sum(len(loan.block_ids) for loan in self.loans.values())
