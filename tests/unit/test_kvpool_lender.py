"""The rManager's BlockLender on a real engine, in process (no sockets): lending stops at the
reserve, stored KV gives the same micro-attention as computed directly, every block comes back."""

import threading

import grpc
import pytest
import torch

from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.loader import load_model
from pdserve.kvpool.attention import from_bytes, micro_attention
from pdserve.kvpool.rmanager import BlockLender
from pdserve.protos import KVPOOL_VERSION, kvpool_pb2


class Aborted(Exception):
    pass


class Context:
    def abort(self, code, details):
        raise Aborted(code, details)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(load_model("tiny", seed=0), EngineConfig(num_blocks=6, block_size=16))


def _lend(lender, rid, blocks, borrower="b", layout=None):
    return lender.Lend(kvpool_pb2.LendRequest(borrower=borrower, request_id=rid, blocks=blocks,
                                              layout=layout or lender.layout, version=KVPOOL_VERSION), Context())


def test_lending_keeps_the_reserve_and_every_block_comes_back(engine):
    lender = BlockLender(engine, threading.Lock(), reserve=2, idle_s=60.0)
    reply = _lend(lender, "r1", 10)
    assert reply.granted_blocks == 4 and "lent 4 of 10" in reply.refusal
    assert engine.num_free_blocks() == 2
    refused = _lend(lender, "r2", 1, borrower="c")
    assert refused.granted_blocks == 0 and "reserve 2" in refused.refusal
    row = lender.report("me", "me:1")
    assert (row.free_blocks, row.lendable_blocks, [(d.borrower, d.blocks) for d in row.lent]) == (2, 0, [("b", 4)])
    assert lender.Release(kvpool_pb2.ReleaseRequest(request_id="r1"), Context()).freed_blocks == 4
    assert engine.num_free_blocks() == 6 and lender.book.loans == {} and engine.num_requests() == 0


def test_a_peer_with_another_kv_layout_is_refused(engine):
    lender = BlockLender(engine, threading.Lock(), reserve=0, idle_s=60.0)
    reply = _lend(lender, "r1", 1, layout="4/2/16/16/bfloat16")
    assert reply.granted_blocks == 0 and "incompatible peer" in reply.refusal
    assert engine.num_free_blocks() == 6


def test_stored_kv_gives_the_micro_attention_computed_directly(engine):
    lender = BlockLender(engine, threading.Lock(), reserve=0, idle_s=60.0, gone_s=0.0)
    assert _lend(lender, "r1", 4).granted_blocks == 4
    cfg = engine.model_config
    k, v = torch.randn(50, cfg.num_kv_heads, cfg.head_dim), torch.randn(50, cfg.num_kv_heads, cfg.head_dim)
    for start, end in ((0, 30), (30, 50)):  # two puts, as a prefill and then more tokens would
        lender.PutKV(kvpool_pb2.PutKVRequest(request_id="r1", layer=2, start=start, num_tokens=end - start,
                                             k=k[start:end].numpy().tobytes(), v=v[start:end].numpy().tobytes()),
                     Context())
    q = torch.randn(cfg.num_heads, cfg.head_dim)
    r = lender.Attend(kvpool_pb2.AttendRequest(request_id="r1", layer=2, q=q.numpy().tobytes(),
                                               num_heads=cfg.num_heads), Context())
    got, want = from_bytes(r.max, r.sum_exp, r.weighted, cfg.num_heads), micro_attention(q, k, v)
    for a, b in ((got.max, want.max), (got.sum_exp, want.sum_exp), (got.weighted, want.weighted)):
        assert torch.equal(a, b)
    with pytest.raises(Aborted, match="do not fit the loan's 64 slots"):
        lender.PutKV(kvpool_pb2.PutKVRequest(request_id="r1", layer=0, start=60, num_tokens=5,
                                             k=k[:5].numpy().tobytes(), v=v[:5].numpy().tobytes()), Context())
    with pytest.raises(Aborted, match="layer 9 out of range"):
        lender.Attend(kvpool_pb2.AttendRequest(request_id="r1", layer=9, q=q.numpy().tobytes(), num_heads=4), Context())
    with pytest.raises(Aborted, match="must be 1024 bytes"):
        lender.PutKV(kvpool_pb2.PutKVRequest(request_id="r1", layer=0, start=0, num_tokens=8, k=b"x", v=b"x"),
                     Context())
    # the borrower left the gManager's live set: the loan is freed
    assert lender.sweep({"someone-else"}) == ["r1"]
    assert engine.num_free_blocks() == 6
    with pytest.raises(Aborted) as e:
        lender.Attend(kvpool_pb2.AttendRequest(request_id="r1", layer=0, q=q.numpy().tobytes(), num_heads=4), Context())
    assert e.value.args[0] == grpc.StatusCode.NOT_FOUND and "no loan for request 'r1'" in e.value.args[1]


def test_a_fresh_gmanager_says_its_live_list_is_not_complete_for_one_ttl(monkeypatch):
    from pdserve.kvpool import gmanager as gm

    clock = [100.0]
    monkeypatch.setattr(gm.time, "monotonic", lambda: clock[0])
    g = gm.GManager(ttl_s=2.0)
    report = kvpool_pb2.InstanceReport(instance_id="a", address="a:1", free_blocks=4, lendable_blocks=3,
                                       lent=[kvpool_pb2.Debt(borrower="b", blocks=1)], version=KVPOOL_VERSION)
    first = g.Report(report, Context())
    assert list(first.live_instances) == ["a"] and not first.complete  # "b" may just not have reported yet
    clock[0] += 2.5
    assert g.Report(report, Context()).complete
    found = g.FindLenders(kvpool_pb2.FindLendersRequest(borrower="b", blocks=2), Context()).candidates
    assert [(c.instance_id, c.lendable_blocks) for c in found] == [("a", 3)]
    with pytest.raises(Aborted, match="kvpool version 99"):
        g.Report(kvpool_pb2.InstanceReport(instance_id="a", version=99), Context())


class Inbox:
    """Stands in for the decode's CacheStore receiver (one module's unit test): records the
    entries, and 'delivers' a layer's KV by writing it into the expected blocks."""

    def __init__(self, engine):
        self.engine, self.entries, self.dropped = engine, {}, []

    def expect(self, entry_id, block_ids, timeout_s):
        if entry_id in self.entries:
            raise ValueError(f"request {entry_id!r} is already expected")
        self.entries[entry_id] = list(block_ids)
        return b"endpoint", list(block_ids), b"t" * 16

    def deliver(self, entry_id, layer, k, v):
        kv = self.engine.kv_cache
        rows = kv.table_rows(torch.tensor(self.entries[entry_id])).reshape(-1)[: k.shape[0]]
        kv.write(layer, rows, k, v)

    def wait(self, entry_id, timeout_s):
        if entry_id not in self.entries:
            raise TimeoutError(f"{entry_id!r} not all arrived")
        del self.entries[entry_id]

    def drop(self, entry_id):
        self.entries.pop(entry_id, None)
        self.dropped.append(entry_id)


def test_kv_pushed_by_the_prefill_through_the_cachestore_is_attended_over_and_released(engine):
    lender = BlockLender(engine, threading.Lock(), reserve=0, idle_s=60.0)
    lender.inbox = inbox = Inbox(engine)
    assert _lend(lender, "r1", 4).granted_blocks == 4
    cfg = engine.model_config
    k, v = torch.randn(40, cfg.num_kv_heads, cfg.head_dim), torch.randn(40, cfg.num_kv_heads, cfg.head_dim)
    reply = lender.ExpectKV(kvpool_pb2.ExpectKVRequest(request_id="r1", num_tokens=40, timeout_s=5.0,
                                                       entry_id="r1#part0"), Context())
    assert reply.cachestore_endpoint == b"endpoint" and len(reply.block_ids) == 3  # 40 tokens: 3 blocks of 16
    assert reply.kv_token == b"t" * 16  # the receiver's bind token, for the prefill's bind
    with pytest.raises(Aborted, match="already expected"):
        lender.ExpectKV(kvpool_pb2.ExpectKVRequest(request_id="r1", num_tokens=40, timeout_s=5.0,
                                                   entry_id="r1#part0"), Context())
    q = torch.randn(cfg.num_heads, cfg.head_dim)
    attend = kvpool_pb2.AttendRequest(request_id="r1", layer=1, q=q.numpy().tobytes(), num_heads=cfg.num_heads)
    with pytest.raises(Aborted, match="put no KV here yet"):  # not before KVArrived
        lender.Attend(attend, Context())
    inbox.deliver("r1#part0", 1, k, v)
    lender.KVArrived(kvpool_pb2.KVArrivedRequest(request_id="r1", timeout_s=5.0), Context())
    r = lender.Attend(attend, Context())
    got, want = from_bytes(r.max, r.sum_exp, r.weighted, cfg.num_heads), micro_attention(q, k, v)
    assert torch.equal(got.weighted, want.weighted) and torch.equal(got.max, want.max)
    assert lender.Release(kvpool_pb2.ReleaseRequest(request_id="r1"), Context()).freed_blocks == 4
    assert inbox.dropped == [] and engine.num_free_blocks() == 6  # the entry was unpinned on arrival already

    # released before its KV arrived (the borrower's request failed): the entry is dropped first
    assert _lend(lender, "r2", 2).granted_blocks == 2
    lender.ExpectKV(kvpool_pb2.ExpectKVRequest(request_id="r2", num_tokens=20, timeout_s=5.0, entry_id="r2#part0"),
                    Context())
    lender.release("r2")
    assert inbox.dropped == ["r2#part0"] and inbox.entries == {} and engine.num_free_blocks() == 6
    with pytest.raises(Aborted) as e:  # a loan it never made
        BlockLender(engine, threading.Lock(), reserve=0, idle_s=60.0).ExpectKV(
            kvpool_pb2.ExpectKVRequest(request_id="r3", num_tokens=1, timeout_s=1.0, entry_id="x"), Context())
    assert e.value.args[0] == grpc.StatusCode.NOT_FOUND
