"""LoanBook: one rManager's record of the blocks it lent (pure Python, no I/O, no torch).

A loan is (request id, borrower, block ids, tokens written). Lending is bounded: the rManager
keeps ``reserve`` blocks free for its own requests, so ``lendable = max(0, free - reserve)``.
A loan ends (its blocks go back to the pool) when the borrower releases the request (it
finished or failed), when the borrower has been missing from the gManager's live lists for
``gone_s``, or when the loan was idle (no put or attend) for ``idle_s``; ``lent()`` is the
ledger row reported.
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
    missing_since: float | None = None  # when the gManager's live list first lacked the borrower


class LoanBook:
    def __init__(self, reserve: int, idle_s: float, gone_s: float = 1.0):
        if reserve < 0:
            raise ValueError(f"reserve must be >= 0, got {reserve}")
        self.reserve, self.idle_s, self.gone_s = reserve, idle_s, gone_s
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
        """Request ids whose borrower has been missing from every live list for ``gone_s`` (one
        list alone may come from a gManager that has not heard from it yet), or idle for idle_s."""
        out = []
        for rid, loan in self.loans.items():
            if live is not None:
                if loan.borrower in live:
                    loan.missing_since = None
                elif loan.missing_since is None:
                    loan.missing_since = now
            gone = loan.missing_since is not None and now - loan.missing_since >= self.gone_s
            if gone or now - loan.used_at > self.idle_s:
                out.append(rid)
        return out

    def lent(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for loan in self.loans.values():
            out[loan.borrower] = out.get(loan.borrower, 0) + len(loan.block_ids)
        return out

    def lent_blocks(self) -> int:
        return sum(len(loan.block_ids) for loan in self.loans.values())
