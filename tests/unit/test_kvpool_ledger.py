"""The pool's bookkeeping under random lend/borrow/free sequences: lenders' LoanBooks and the
gManager's DebtLedger rebuilt from their reports never go negative, never lend into a lender's
reserve, agree with each other, and return to zero when every request ends."""

import random

import pytest

from pdserve.kvpool.ledger import DebtLedger
from pdserve.kvpool.loans import Loan, LoanBook


class Lender:
    """A lender as the rManager runs it: a pool of blocks, a LoanBook, reports to the ledger."""

    def __init__(self, name, blocks, reserve):
        self.name, self.blocks, self.free = name, blocks, blocks
        self.book = LoanBook(reserve, idle_s=1e9)

    def lend(self, borrower, rid, want, now):
        n = self.book.grant(want, self.free)
        if n:
            self.book.add(Loan(rid, borrower, list(range(n)), 0, now))
            self.free -= n
        return n

    def release(self, rid):
        loan = self.book.pop(rid)
        if loan:
            self.free += len(loan.block_ids)

    def report(self, ledger, now):
        ledger.report(self.name, f"{self.name}:1", self.free, self.book.lendable(self.free), self.book.lent(), now)


@pytest.mark.parametrize("seed", range(25))
def test_random_lend_borrow_free_never_negative_and_returns_to_zero(seed):
    rnd = random.Random(seed)
    lenders = {f"d{i}": Lender(f"d{i}", rnd.randint(2, 20), rnd.randint(0, 4)) for i in range(rnd.randint(2, 5))}
    ledger, now = DebtLedger(ttl_s=5.0), 0.0
    open_requests: dict[str, list[str]] = {}  # request -> lenders holding part of it
    for step in range(300):
        now += 0.01
        op = rnd.random()
        if op < 0.5:  # a borrower spills a request: asks the ledger's candidates in turn
            borrower, rid = rnd.choice(sorted(lenders)), f"r{step}"
            need, held = rnd.randint(1, 15), []
            for name, _, lendable in ledger.candidates(borrower, need):
                assert lendable > 0 and name != borrower
                got = lenders[name].lend(borrower, rid, need, now)
                need -= got
                if got:
                    held.append(name)
                if need == 0:
                    break
            if need:  # not enough room: the borrower gives back what it got
                for name in held:
                    lenders[name].release(rid)
            elif held:
                open_requests[rid] = held
        elif open_requests:  # a request finishes or fails: every loan released
            rid = rnd.choice(sorted(open_requests))
            for name in open_requests.pop(rid):
                lenders[name].release(rid)
        for lender in lenders.values():  # loose consistency: some reports arrive late
            if rnd.random() < 0.7:
                lender.report(ledger, now)
            assert 0 <= lender.free <= lender.blocks
            lent = lender.book.lent_blocks()
            assert lent == lender.blocks - lender.free
            assert lent <= max(0, lender.blocks - lender.book.reserve), "lent into the reserve"
        assert all(n > 0 for n in ledger.debts().values())
    for rid in sorted(open_requests):
        for name in open_requests.pop(rid):
            lenders[name].release(rid)
    for lender in lenders.values():
        lender.report(ledger, now)
        assert lender.free == lender.blocks and lender.book.loans == {}
    assert ledger.debts() == {} and ledger.total_lent() == 0


def test_a_restarted_gmanager_rebuilds_the_ledger_from_one_round_of_reports():
    a, b = Lender("a", 10, 2), Lender("b", 10, 2)
    old = DebtLedger(ttl_s=5.0)
    for lender in (a, b):
        lender.report(old, 0.0)
    a.lend("b", "r1", 5, 0.0)
    b.lend("a", "r2", 3, 0.0)
    for lender in (a, b):
        lender.report(old, 1.0)
    fresh = DebtLedger(ttl_s=5.0)  # the restart
    for lender in (a, b):
        lender.report(fresh, 2.0)
    assert fresh.debts() == old.debts() == {("a", "b"): 5, ("b", "a"): 3}
    assert fresh.candidates("b", 1) == [("a", "a:1", 3)]


def test_silent_instances_expire_with_their_rows_and_bad_reports_are_refused():
    ledger = DebtLedger(ttl_s=1.0)
    ledger.report("a", "a:1", 4, 3, {"b": 2}, now=0.0)
    ledger.report("b", "b:1", 4, 3, {}, now=0.5)
    assert ledger.owed_by("b") == 2
    assert ledger.expire(now=1.2) == ["a"]
    assert ledger.debts() == {} and ledger.live() == ["b"]
    with pytest.raises(ValueError, match="lendable <= free"):
        ledger.report("c", "c:1", 2, 3, {}, now=1.2)
    with pytest.raises(ValueError, match="cannot lend to itself"):
        ledger.report("c", "c:1", 2, 1, {"c": 1}, now=1.2)
    with pytest.raises(ValueError, match="blocks must be positive"):
        ledger.candidates("b", 0)


def test_loans_of_a_gone_borrower_or_idle_ones_are_stale():
    book = LoanBook(reserve=1, idle_s=10.0, gone_s=1.0)
    assert book.grant(5, free_blocks=4) == 3 and book.grant(5, free_blocks=1) == 0
    book.add(Loan("r1", "x", [0], 0, used_at=0.0))
    book.add(Loan("r2", "y", [1], 0, used_at=5.0))
    assert book.stale({"x", "y"}, now=11.0) == ["r1"]
    assert book.stale({"x"}, now=6.0) == []       # one list without "y": maybe it has not reported yet
    assert book.stale({"x", "y"}, now=6.5) == []  # back: the count starts over
    assert book.stale({"x"}, now=6.6) == []
    assert book.stale(None, now=7.0) == []        # no answer from the gManager: no news either way
    assert book.stale({"x"}, now=7.7) == ["r2"]   # missing for >= gone_s
    with pytest.raises(ValueError, match="already holds a loan"):
        book.add(Loan("r1", "x", [2]))


def test_a_row_keeps_the_most_its_instance_ever_lends():
    ledger = DebtLedger(ttl_s=5.0)
    ledger.report("d0", "h:1", free_blocks=3, lendable_blocks=2, lent={"d1": 4}, now=0.0, max_lendable=7)
    ledger.report("d1", "h:2", free_blocks=5, lendable_blocks=4, lent={}, now=0.0)  # an old rManager: no max sent
    assert (ledger.rows["d0"].max_lendable, ledger.rows["d1"].max_lendable) == (7, 4)
