"""kvpool/rmanager.py Borrower.borrow with fake gManager and lender stubs: loans that cover the need, a pool
that is short (OutOfBlocksError), and a lender that does not answer while lending (LenderLost naming it);
every loan taken is given back on a failure."""

from types import SimpleNamespace

import grpc
import pytest

from pdserve.engine import OutOfBlocksError
from pdserve.kvpool import rmanager
from pdserve.kvpool.rmanager import Borrower, LenderLost


class Silent(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


class Lender:
    def __init__(self, free: int | None):
        self.free, self.released = free, []  # free None: the process is gone (every call fails)

    def Lend(self, request, timeout=None):
        if self.free is None:
            raise Silent()
        granted = min(self.free, request.blocks)
        self.free -= granted
        return SimpleNamespace(granted_blocks=granted)

    def Release(self, request, timeout=None):
        self.released.append(request.request_id)


def borrower(lenders: dict[str, Lender]) -> Borrower:
    candidates = [SimpleNamespace(instance_id=name, address=name) for name in lenders]

    class GManager:
        def FindLenders(self, request, timeout=None):
            return SimpleNamespace(candidates=[c for c in candidates if c.instance_id not in request.exclude])

    b = Borrower("decode-0", GManager(), "layout", rpc_timeout_s=1.0)
    b.stub = lambda address: lenders[address]
    return b


@pytest.fixture(autouse=True)
def no_pause(monkeypatch):
    monkeypatch.setattr(rmanager.time, "sleep", lambda s: None)  # the rounds' pauses (the gManager catching up)


def test_loans_cover_the_need_past_a_stale_listing():
    lenders = {"gone": Lender(None), "decode-1": Lender(7), "decode-2": Lender(8)}
    loans = borrower(lenders).borrow("r", 11)
    assert [(l.lender, l.blocks) for l in loans] == [("decode-1", 7), ("decode-2", 4)]


def test_a_short_pool_is_out_of_blocks_and_gives_every_loan_back():
    lenders = {"decode-1": Lender(7)}
    with pytest.raises(OutOfBlocksError, match="had only 7 to lend"):
        borrower(lenders).borrow("r", 11)
    assert lenders["decode-1"].released == ["decode-0/r"]


def test_a_lender_silent_while_lending_is_named_and_every_loan_given_back():
    lenders = {"decode-1": Lender(7), "decode-2": Lender(None)}
    with pytest.raises(LenderLost, match="KV lender decode-2 did not answer while lending") as info:
        borrower(lenders).borrow("victim", 11)
    assert "'victim'" in str(info.value) and "only 7 of the 11" in str(info.value)
    assert lenders["decode-1"].released == ["decode-0/victim"]
