"""Pure parts of the CacheStore: layout/compat validation, run merging, frames, MoLink/FIFO scheduler."""

import socket

import pytest

from pdserve.cachestore import CompatInfo, KVLayout, MemoryRegion, merge_runs
from pdserve.cachestore.endpoint import Endpoint
from pdserve.cachestore.errors import ProtocolError
from pdserve.cachestore.frames import FLAG_CRC32C, FrameType, encode_control, encode_header, read_frame_header
from pdserve.cachestore.nixl_backend import decode_notif, encode_notif
from pdserve.cachestore.scheduler import FifoScheduler, PriorityScheduler, Transfer


def test_layout_offsets_and_validation():
    layout = KVLayout(num_layers=3, num_blocks=10, block_nbytes=100)
    assert layout.offset(0, 0) == 0
    assert layout.offset(1, 2) == (10 + 2) * 100
    assert layout.nbytes == 3000
    with pytest.raises(ValueError, match="num_blocks"):
        KVLayout(3, 0, 100)
    with pytest.raises(ValueError, match="out of range"):
        layout.check_blocks([3, 10])
    with pytest.raises(ValueError, match="appears twice"):
        layout.check_blocks([3, 3])
    with pytest.raises(ValueError, match="not an int"):
        layout.check_blocks(["3"])
    with pytest.raises(ValueError, match="layer 3 out of range"):
        layout.check_layer(3)
    assert layout.check_blocks([-1, 4], allow_skip=True) == [-1, 4]


def test_compat_hash_and_layout_check():
    a = CompatInfo("float16", 32, 8, 128, 64)
    assert a.block_nbytes == 2 * 64 * 8 * 128 * 2
    assert a.compat_hash == CompatInfo("float16", 32, 8, 128, 64).compat_hash
    assert a.compat_hash != CompatInfo("float16", 32, 8, 128, 16).compat_hash
    assert a.compat_hash != CompatInfo("bfloat16", 32, 8, 128, 64).compat_hash
    with pytest.raises(ValueError, match="dtype 'fp13'"):
        CompatInfo("fp13", 32, 8, 128, 64)
    with pytest.raises(ValueError, match="block_nbytes"):
        a.check_layout(KVLayout(32, 4, 123))
    with pytest.raises(ValueError, match="layers"):
        a.check_layout(KVLayout(31, 4, a.block_nbytes))


def test_memory_region_from_tensor():
    torch = pytest.importorskip("torch")
    t = torch.zeros(4, 8)
    r = MemoryRegion.from_tensor(t)
    assert (r.ptr, r.nbytes, r.device) == (t.data_ptr(), 128, "cpu")
    r.host_view()[0:4] = b"\x00\x00\x80\x3f"  # float32 1.0, written through the view
    assert t[0, 0].item() == 1.0
    with pytest.raises(ValueError, match="contiguous"):
        MemoryRegion.from_tensor(t.t())
    with pytest.raises(ValueError, match="needs 4096 bytes"):
        r.check_layout(KVLayout(2, 2, 1024))


def test_merge_runs_merges_contiguous_on_both_sides_and_skips_shared():
    assert merge_runs([0, 1, 2, 7, 8], [10, 11, 12, 3, 4]) == [(0, 10, 3), (7, 3, 2)]
    assert merge_runs([0, 1, 2], [10, 12, 13]) == [(0, 10, 1), (1, 12, 2)]
    assert merge_runs([0, 1, 2, 3], [5, -1, 7, 8]) == [(0, 5, 1), (2, 7, 2)]
    with pytest.raises(ValueError, match="3 source blocks but 2"):
        merge_runs([0, 1, 2], [0, 1])


def test_frames_roundtrip_and_garbage():
    a, b = socket.socketpair()
    try:
        a.sendall(encode_header(FrameType.DATA, "req-1", 3, 42, 5, 0, FLAG_CRC32C, 0xFEEDF00D))
        a.sendall(encode_control(FrameType.ERROR, "", b"why"))
        f = read_frame_header(b)
        assert (f.type, f.rid, f.layer, f.block, f.nblocks) == (FrameType.DATA, "req-1", 3, 42, 5)
        assert (f.flags, f.crc) == (FLAG_CRC32C, 0xFEEDF00D)
        f = read_frame_header(b)
        assert f.type == FrameType.ERROR and f.payload_len == 3 and b.recv(3) == b"why"
        a.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 40)
        with pytest.raises(ProtocolError, match="bad frame magic"):
            read_frame_header(b)
    finally:
        a.close(), b.close()
    a, b = socket.socketpair()
    a.sendall(encode_header(FrameType.ACK, "r", 1, 2, 3)[:20])
    a.close()
    with pytest.raises(ProtocolError, match="closed mid-frame"):
        read_frame_header(b)
    b.close()


def test_endpoint_and_notif_roundtrip():
    ep = Endpoint("127.0.0.1", 1234, "nixl", "abcd", "dtype=...", "inst", num_blocks=9,
                  nixl_agent="a", nixl_metadata=b"\x00\x01", nixl_region=(1, 2, 0, "DRAM"))
    back = Endpoint.from_bytes(ep.to_bytes())
    assert back == ep
    with pytest.raises(ValueError, match="not a pdserve CacheStore endpoint"):
        Endpoint.from_bytes(b"hello")
    tok9, tok10 = b"9" * 16, b"t" * 16
    records = [("r-9", 7, tok9, [(3, 2, 0xDEADBEEF), (10, 1, 5)]), ("r-10", 0, tok10, [(1, 1, 0)])]
    assert decode_notif(encode_notif(records, checksum=True)) == (True, records)
    # without checksums the crc fields go out as 0 and the flag says they mean nothing
    assert decode_notif(encode_notif(records)) == (False, [("r-9", 7, tok9, [(3, 2, 0), (10, 1, 0)]),
                                                           ("r-10", 0, tok10, [(1, 1, 0)])])
    with pytest.raises(ProtocolError, match="truncated"):
        decode_notif(encode_notif(records)[:-3])
    with pytest.raises(ProtocolError, match="bad magic"):
        decode_notif(b"PDNX\x00\x00\x01")  # a protocol-1 notification is refused, not misread


def _t(key, nblocks, priority=0):
    return Transfer(key, 0, [(0, 0, nblocks)], priority)


def test_priority_scheduler_sends_short_first_and_chunks_large():
    s = PriorityScheduler(chunk_blocks=4, max_wait=30)
    s.push(_t("big", 10))
    s.push(_t("small", 2))
    s.push(_t("urgent-big", 9, priority=5))
    order = []
    while (c := s.pop()) is not None:
        order.append((c.transfer.key, c.nblocks))
    # urgent (priority) first, then short, then the big one in chunks of 4
    assert order == [("urgent-big", 9), ("small", 2), ("big", 4), ("big", 4), ("big", 2)]


def test_priority_scheduler_waiting_weight_bounds_starvation():
    s = PriorityScheduler(chunk_blocks=2, max_wait=30)
    s.push(_t("big", 100))
    for i in range(100):
        s.push(_t(f"s{i}", 1))
    keys = [s.pop().transfer.key for _ in range(30)]
    # 29 short transfers overtake the big one, then the weight reaches 30: the big one goes, in full
    assert keys[:29] == [f"s{i}" for i in range(29)]
    assert keys[29] == "big"
    assert s.waiting_weight == 0
    rest = []
    while (c := s.pop()) is not None:
        rest.append(c.transfer.key)
    assert "big" not in rest and len(rest) == 71


def test_priority_scheduler_progress_with_steady_short_stream():
    """With short transfers arriving forever, the large one still completes (no starvation)."""
    s = PriorityScheduler(chunk_blocks=2, max_wait=3)
    s.push(_t("big", 6))
    big_sent, i = 0, 0
    while big_sent < 6:
        s.push(_t(f"s{i}", 1))
        i += 1
        c = s.pop()
        if c.transfer.key == "big":
            big_sent += c.nblocks
        assert i < 50
    assert big_sent == 6


def test_fifo_and_remove():
    f = FifoScheduler()
    f.push(_t("a", 10))
    f.push(_t("b", 1))
    f.push(_t("a", 3))
    assert f.remove("a") == 2 and len(f) == 1
    c = f.pop()
    assert (c.transfer.key, c.nblocks) == ("b", 1) and f.pop() is None
    p = PriorityScheduler(chunk_blocks=4)
    p.push(_t("a", 10)), p.push(_t("b", 1)), p.push(_t("a", 1))
    assert p.remove("a") == 2 and p.pop().transfer.key == "b" and p.pop() is None


def test_transfer_take_spans_runs():
    t = Transfer("r", 2, [(0, 10, 3), (5, 20, 2)])
    assert t.take(4) == [(0, 10, 3), (5, 20, 1)]
    assert t.take(4) == [(6, 21, 1)]
    assert t.left == 0


def test_nixl_import_is_guarded(monkeypatch):
    torch = pytest.importorskip("torch")
    import sys

    from pdserve.cachestore import CacheStoreReceiver, CacheStoreSender

    for name in ("nixl", "nixl._api", "nixl_cu12", "nixl_cu12._api", "nixl_cu13", "nixl_cu13._api"):
        monkeypatch.setitem(sys.modules, name, None)  # as if neither package were installed
    compat = CompatInfo("float32", 1, 1, 4, 2)
    pool = torch.zeros(1, 4, 2, 2, 1, 4)
    args = (MemoryRegion.from_tensor(pool), KVLayout(1, 4, compat.block_nbytes), compat)
    with pytest.raises(RuntimeError, match=r"transport='nixl' needs the NIXL Python package.*pdserve\[nixl\]"):
        CacheStoreReceiver(*args, transport="nixl")
    with pytest.raises(RuntimeError, match="transport='nixl' needs"):
        CacheStoreSender(*args, transport="nixl")
    CacheStoreReceiver(*args, transport="tcp")  # tcp does not need it
    with pytest.raises(ValueError, match="transport must be one of"):
        CacheStoreSender(*args, transport="rdma")


def test_link_moves_no_chunk_while_a_control_frame_waits():
    """A request's BIND is handed to the kernel before any of its bytes move (by NIXL or on another
    connection): a sender killed after its data moved then always leaves the receiver a bound entry
    to fail, instead of one that waits out its expect timeout (seen once in CI, nixl)."""
    import torch

    from pdserve.cachestore.link import Link, LinkConfig

    compat = CompatInfo("float32", 1, 1, 1, 1)
    layout = KVLayout(1, 4, compat.block_nbytes)
    config = LinkConfig(MemoryRegion.from_tensor(torch.zeros(8)), layout, compat, chunk_blocks=4, connections=1,
                        connect_timeout_s=1.0)
    ep = Endpoint("127.0.0.1", 1, "nixl", compat.compat_hash, compat.describe(), "i", num_blocks=4)
    link = Link(owner=None, endpoint=ep, scheduler=FifoScheduler(), config=config)  # never started: no threads
    link.send_control(encode_control(FrameType.BIND, "r"))
    link.submit(Transfer("r", 0, [(0, 1, 2)]))
    assert link.take_chunks(4, 4, wait=False) == []  # BIND queued
    with link.cond:  # connection 0's writer pops it and is sending it
        link.control.popleft()
        link.control_sending += 1
    assert link.take_chunks(4, 4, wait=False) == []
    with link.cond:
        link.control_sending -= 1
    batch = link.take_chunks(4, 4, wait=False)
    assert [(c.transfer.key, c.nblocks) for c in batch] == [("r", 2)] and link.sending == 1


def test_each_transport_implements_both_sides_of_the_interface():
    """transport.py declares what the sender, receiver and link call; both transports implement
    every member, with the same parameters (a missing or renamed one fails here, not at a request)."""
    import inspect

    from pdserve.cachestore import transport as t

    for protocol, impls in ((t.ReceiveSide, (t.TcpReceive, t.NixlReceive)), (t.SendSide, (t.TcpSend, t.NixlSend))):
        members = {n for n in vars(protocol) if not n.startswith("_")} | set(protocol.__annotations__)
        for impl in impls:
            for name in members:
                assert hasattr(impl, name), f"{impl.__name__} lacks {protocol.__name__}.{name}"
                want = vars(protocol).get(name)
                if inspect.isfunction(want):
                    assert (list(inspect.signature(getattr(impl, name)).parameters)
                            == list(inspect.signature(want).parameters)), f"{impl.__name__}.{name}"
            assert impl.name in t.TRANSPORTS
    with pytest.raises(ValueError, match="transport must be one of"):
        t.send_side("rdma", MemoryRegion.from_tensor(__import__("torch").zeros(4)))
