"""CacheStore failures and teardown in one process, both transports: compat refusal, unknown ids,
timeouts and cancellation, reconnects, garbage frames, delete mid-frame, pins released at delete,
idle links. Every test ends with nothing held on either side."""

import asyncio
import socket
import threading

import pytest
import torch

from pdserve.cachestore import (CacheStoreReceiver, CacheStoreSender, CompatError, CompatInfo, KVLayout,
                                MemoryRegion, TransferError, UnknownRequestError)
from pdserve.cachestore.endpoint import Endpoint

from harness.cachestore_pair import BS, COMPAT, LAYOUT, NB, NO_TOKEN, PAIR_TRANSPORTS, D, H, L, Pair, pool, run
from harness.conditions import settle, until


def test_compat_mismatch_refused_with_both_values():
    async def main():
        other = CompatInfo("float32", L, H, D, BS * 2)
        dst = torch.zeros(L, NB, 2, BS * 2, H, D)
        rx = CacheStoreReceiver(MemoryRegion.from_tensor(dst), KVLayout(L, NB, other.block_nbytes), other)
        await rx.start()
        tx = CacheStoreSender(MemoryRegion.from_tensor(pool(True)), LAYOUT, COMPAT)
        await tx.start()
        try:
            with pytest.raises(CompatError) as info:
                tx.bind("r", rx.endpoint, [1], NO_TOKEN)
            msg = str(info.value)
            assert (other.compat_hash in msg and COMPAT.compat_hash in msg
                    and "block_size=32" in msg and "block_size=16" in msg)
            # a forged endpoint that claims our hash: the receiver itself refuses at HELLO
            ep = Endpoint.from_bytes(rx.endpoint)
            ep.compat_hash = COMPAT.compat_hash
            tx.bind("r", ep.to_bytes(), rx.expect("r", [1], 10))
            for l in range(L):
                tx.store("r", l, [0])
            with pytest.raises(CompatError) as info:
                await tx.wait_sent("r", 10)
            assert other.compat_hash in str(info.value) and COMPAT.compat_hash in str(info.value)
            assert rx.stats()["connections_refused"] == 1
            rx.delete("r"), tx.delete("r")
            assert rx.stats()["pinned_entries"] == tx.stats()["pinned_entries"] == 0
        finally:
            await tx.stop()
            await rx.stop()
    run(main())


@pytest.mark.parametrize("transport", PAIR_TRANSPORTS)
def test_unknown_request_ids(transport):
    async def main():
        async with Pair(transport) as p:
            with pytest.raises(UnknownRequestError, match="'nope'"):
                p.tx.store("nope", 0, [1])
            with pytest.raises(UnknownRequestError, match="'nope'"):
                await p.rx.load("nope", 0, 1)
            with pytest.raises(UnknownRequestError, match="'nope'"):
                await p.tx.wait_sent("nope", 1)
            # the sender binds a request the receiver never expected
            p.tx.bind("ghost", p.rx.endpoint, [3], NO_TOKEN)
            for l in range(L):
                p.tx.store("ghost", l, [3])
            with pytest.raises(TransferError, match="ghost"):
                await p.tx.wait_sent("ghost", 10)
            if transport == "tcp":  # (nixl WRITEs are one-sided: README)
                assert torch.count_nonzero(p.dst) == 0  # nothing was written
            p.tx.delete("ghost")
            # bad input gets clear errors
            with pytest.raises(ValueError, match="out of range"):
                p.rx.expect("r", [NB], 5)
            with pytest.raises(ValueError, match="timeout_s"):
                p.rx.expect("r", [1], 0)
            with pytest.raises(ValueError, match="timeout_s"):
                await p.rx.wait_all("r", -1)
            with pytest.raises(ValueError, match="timeout_s"):
                await p.tx.wait_sent("r", 0)
            dst = p.rx.expect("r", [1, 2], 5)
            p.tx.bind("r", p.rx.endpoint, dst)
            with pytest.raises(ValueError, match="2 destination blocks"):
                p.tx.store("r", 0, [1, 2, 3])
            p.tx.store("r", 0, [1, 2])
            with pytest.raises(ValueError, match="stored twice"):
                p.tx.store("r", 0, [1, 2])
            # a layer in parts (a chunked prefill): in block order, none twice, none skipped
            with pytest.raises(ValueError, match=r"blocks \[0, 1\) skipped"):
                p.tx.store("r", 1, [2], first=1)
            p.tx.store("r", 1, [1])
            with pytest.raises(ValueError, match="stored twice"):
                p.tx.store("r", 1, [1], first=0)
            p.tx.store("r", 1, [2], first=1)
            p.rx.delete("r"), p.tx.delete("r")
            await p.assert_clean()
    run(main())


@pytest.mark.parametrize("transport", PAIR_TRANSPORTS)
def test_timeouts_and_cancellation_free_entries(transport):
    async def main():
        async with Pair(transport) as p:
            # expect timeout: nothing arrives
            p.rx.expect("t1", [1], timeout_s=0.3)
            # the entry's own 0.3 s timeout, not the wait's 5 s (whose message is "did not arrive within 5s")
            with pytest.raises(TransferError, match="within the expect timeout of 0.3s"):
                await p.rx.wait_all("t1", 5)
            # a wait's own timeout fails the entry and tells the sender
            p.tx.bind("t2", p.rx.endpoint, p.rx.expect("t2", [2], 30))
            p.tx.store("t2", 0, [2])
            await p.rx.load("t2", 0, 5)
            with pytest.raises(TransferError, match="did not arrive within 0.2s"):
                await p.rx.wait_all("t2", 0.2)
            with pytest.raises(TransferError, match="t2"):
                await p.tx.wait_sent("t2", 5)
            # cancelling a waiting task only ends that wait
            p.rx.expect("t3", [3], 30)
            task = asyncio.create_task(p.rx.load("t3", 1, 30))
            await until(lambda: p.rx.stats()["waiters"] == 1, "the load to wait")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert p.rx.stats()["waiters"] == 0 and p.rx.stats()["pinned_entries"] == 1
            p.rx.delete("t3")
            # the sender gives up (delete mid-transfer): the receiver's waiter hears it
            p.tx.bind("t4", p.rx.endpoint, p.rx.expect("t4", [4], 30))
            p.tx.store("t4", 0, [4])
            await p.rx.load("t4", 0, 5)
            waiter = asyncio.create_task(p.rx.wait_all("t4", 30))
            p.tx.delete("t4")
            with pytest.raises(TransferError, match="sender gave up"):
                await waiter
            # the receiver deletes mid-transfer: the sender hears it
            p.tx.bind("t5", p.rx.endpoint, p.rx.expect("t5", [5], 30))
            p.tx.store("t5", 0, [5])
            await p.rx.load("t5", 0, 5)
            p.rx.delete("t5")
            with pytest.raises(TransferError, match="deleted"):
                await p.tx.wait_sent("t5", 5)
            for rid in ("t1", "t2", "t4", "t5"):
                p.rx.delete(rid), p.tx.delete(rid)
            await p.assert_clean()
    run(main())


def test_reconnects_after_receiver_restart():
    async def main():
        src, dst = pool(True), pool(False)
        tx = CacheStoreSender(MemoryRegion.from_tensor(src), LAYOUT, COMPAT)
        await tx.start()
        port = None
        try:
            for round_ in range(2):
                rx = CacheStoreReceiver(MemoryRegion.from_tensor(dst), LAYOUT, COMPAT, port=port or 0)
                await rx.start()
                port = rx.port
                rid = f"r{round_}"
                tx.bind(rid, rx.endpoint, rx.expect(rid, [round_], 10))
                for l in range(L):
                    tx.store(rid, l, [7])
                await tx.wait_sent(rid, 10)
                assert torch.equal(dst[:, round_], src[:, 7])
                tx.delete(rid), rx.delete(rid)
                await rx.stop()  # the receiver goes away; the next round is a new instance on the same port
            assert tx.stats()["pinned_entries"] == 0
            # nothing listens any more: once the sender has seen its link closed (on a loaded CPU it may
            # not have yet, and the next write met the dead socket: "Broken pipe", 1 run in 10), the
            # request fails with a clear error naming the receiver, nothing stays pinned
            await until(lambda: tx.stats()["links"] == 0, "the sender to see the receiver's link closed")
            ep = Endpoint.from_bytes(rx.endpoint)
            tx.bind("gone", rx.endpoint, [1], NO_TOKEN)
            tx.store("gone", 0, [1])
            with pytest.raises(TransferError, match=f"cannot connect to CacheStore receiver 127.0.0.1:{ep.port}"):
                await tx.wait_sent("gone", 10)
            assert tx.stats()["pinned_entries"] == tx.stats()["inflight_transfers"] == 0
        finally:
            await tx.stop()
    run(main())


def _frame_socket(port, hello=False):
    """A raw client socket; with hello=True it has done a valid handshake (HELLO_OK consumed)."""
    from pdserve.cachestore.frames import FrameType, WIRE_VERSION, encode_json, read_frame_header

    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    if hello:
        s.sendall(encode_json(FrameType.HELLO, {"version": WIRE_VERSION, "compat_hash": COMPAT.compat_hash}))
        f = read_frame_header(s)
        assert f.type == FrameType.HELLO_OK
        s.recv(f.payload_len, socket.MSG_WAITALL)
    return s


def test_garbage_and_truncated_frames_close_only_that_connection():
    from pdserve.cachestore.frames import FrameType, encode_header, read_frame_header

    async def main():
        async with Pair("tcp") as p:
            port = p.rx.port
            # 1. garbage: not even a header
            g = await asyncio.to_thread(_frame_socket, port)
            g.sendall(b"\x16\x03\x01garbage that is not a pdserve frame at all, longer than a header....")
            f = await asyncio.to_thread(read_frame_header, g)
            assert f.type == FrameType.ERROR and b"bad frame magic" in g.recv(f.payload_len)
            assert g.recv(10) == b""  # closed
            g.close()
            # 2. truncated DATA for a real entry: the entry fails, nothing else does
            token = p.rx.expect("victim", [1, 2], 30).token
            t = await asyncio.to_thread(_frame_socket, port, True)
            t.sendall(encode_header(FrameType.BIND, "victim", token=token))
            t.sendall(encode_header(FrameType.DATA, "victim", 0, 1, 2, 2 * LAYOUT.block_nbytes, token=token)
                      + b"\x01" * 100)
            waiter = asyncio.create_task(p.rx.wait_all("victim", 30))
            # meanwhile a real sender is served normally
            p.tx.bind("ok", p.rx.endpoint, p.rx.expect("ok", [9], 30))
            for l in range(L):
                p.tx.store("ok", l, [3])
            await p.tx.wait_sent("ok", 10)
            t.close()  # truncated mid-payload
            with pytest.raises(TransferError, match="closed mid-frame"):
                await waiter
            # 3. a DATA length that does not match the block size: connection-level error
            b = await asyncio.to_thread(_frame_socket, port, True)
            b.sendall(encode_header(FrameType.DATA, "ok", 0, 9, 1, 7))
            f = await asyncio.to_thread(read_frame_header, b)
            assert f.type == FrameType.ERROR and b"does not fit blocks" in b.recv(f.payload_len)
            b.close()
            # 4. DATA for an unknown request id: dropped, answered with ERROR, the connection stays usable
            u = await asyncio.to_thread(_frame_socket, port, True)
            for _ in range(2):
                u.sendall(encode_header(FrameType.DATA, "who", 0, 5, 1, LAYOUT.block_nbytes)
                          + b"\x07" * LAYOUT.block_nbytes)
                f = await asyncio.to_thread(read_frame_header, u)
                assert f.type == FrameType.ERROR and f.rid == "who" and b"does not expect" in u.recv(f.payload_len)
            u.close()
            assert torch.count_nonzero(p.dst[:, 5]) == 0
            await p.rx.wait_all("ok", 5)
            assert p.copied([3], [9])
            p.rx.delete("ok"), p.tx.delete("ok"), p.rx.delete("victim")
            await p.assert_clean()
    run(main())


def test_delete_mid_frame_stops_writing_within_one_piece():
    """A frame already on the wire when its entry is deleted writes at most one more 1 MiB piece."""
    from pdserve.cachestore.frames import FrameType, encode_header, read_frame_header
    from pdserve.cachestore.wire_io import PIECE_BYTES

    big = CompatInfo("float32", 2, 32, 64, 64)  # blocks of exactly 1 MiB
    assert big.block_nbytes == PIECE_BYTES
    layout = KVLayout(2, 8, big.block_nbytes)
    dst = torch.zeros(2, 8, 2, 64, 32, 64)

    async def main():
        rx = CacheStoreReceiver(MemoryRegion.from_tensor(dst), layout, big)
        await rx.start()
        try:
            token = rx.expect("v", [1, 2, 3], 30).token
            s = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", rx.port), 10)
            from pdserve.cachestore.frames import WIRE_VERSION, encode_json
            s.sendall(encode_json(FrameType.HELLO, {"version": WIRE_VERSION, "compat_hash": big.compat_hash}))
            f = await asyncio.to_thread(read_frame_header, s)
            s.recv(f.payload_len, socket.MSG_WAITALL)
            s.sendall(encode_header(FrameType.BIND, "v", token=token))
            s.sendall(encode_header(FrameType.DATA, "v", 0, 1, 3, 3 * PIECE_BYTES, token=token)
                      + b"\x07" * (PIECE_BYTES + PIECE_BYTES // 2))
            for _ in range(500):  # block 1 (the first piece) has landed
                if bool((dst[0, 1].view(-1).view(torch.uint8) == 7).all()):
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the first piece never landed")
            rx.delete("v")
            assert rx.stats()["pinned_entries"] == 1  # the frame still holds it
            release = asyncio.create_task(rx.released("v", 10))
            await settle()
            assert not release.done()  # the frame's second half is still to come: it holds the pin
            await asyncio.to_thread(s.sendall, b"\x07" * (PIECE_BYTES + PIECE_BYTES // 2))
            await release
            assert rx.stats()["pinned_entries"] == 0 and rx.stats()["pinned_blocks"] == 0
            assert torch.count_nonzero(dst[0, 3]) == 0  # the piece after the delete was dropped
            f = await asyncio.to_thread(read_frame_header, s)  # the sender was told
            assert f.type == FrameType.ERROR and f.rid == "v"
            await rx.released("v", 1)  # nothing writes any more: returns at once
            s.close()
        finally:
            await rx.stop()
    run(main())


def test_delete_with_a_chunk_in_flight_releases_the_pin_at_once(monkeypatch):
    """Issue 9 item 5: a chunk's completion held back until after delete(). The pin goes at
    delete, exactly once; the late completion is a no-op (it used to keep the request pinned
    until the chunk completed, which for a NIXL WRITE could be never)."""
    from pdserve.cachestore.wire_io import RegionIO

    on_wire, release = threading.Event(), threading.Event()
    real_send = RegionIO.send

    def held_send(self, *args, **kwargs):
        on_wire.set()
        release.wait(10)
        return real_send(self, *args, **kwargs)

    monkeypatch.setattr(RegionIO, "send", held_send)

    async def main():
        async with Pair("tcp") as p:
            p.tx.bind("d", p.rx.endpoint, p.rx.expect("d", [1], 10))
            p.tx.store("d", 0, [2])
            assert await asyncio.to_thread(on_wire.wait, 10)
            p.tx.delete("d")  # its chunk is still on the wire
            assert p.tx.stats()["pinned_entries"] == 0 and p.tx.stats()["sending_chunks"] == 1
            with pytest.raises(UnknownRequestError):
                p.tx.store("d", 1, [2])
            release.set()  # the completion comes after delete
            for _ in range(500):
                if p.tx.stats()["sending_chunks"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert p.tx.stats()["sending_chunks"] == 0 and p.tx.stats()["bytes_sent"] == 0
            p.rx.delete("d")
            await p.assert_clean()
    run(main())


@pytest.mark.parametrize("transport", PAIR_TRANSPORTS)
def test_idle_link_outlives_the_stall_bounds(transport, monkeypatch):
    """The stall bounds are about no progress while work is pending: a link idle for longer than
    both sides' bounds (and many receive polls) is neither cut nor failed. How long it has been idle
    is what the receiver's own idle reads report (each wakes every RECV_POLL_S with the time since
    the connection's last byte), not a sleep of the test."""
    from pdserve.cachestore import tcp_server

    stall_s = 0.5
    idle_s = 3 * stall_s  # both sides' bounds, and six receive polls
    idle_for: list[float] = []  # what the receiver's idle reads reported: seconds without a byte
    keep_waiting = tcp_server._keep_waiting

    def recorded(stalled_s: float) -> None:
        idle_for.append(stalled_s)
        keep_waiting(stalled_s)

    monkeypatch.setattr(tcp_server, "_keep_waiting", recorded)

    async def main():
        async with Pair(transport, stall_timeout_s=stall_s) as p:
            p.rx._server.stall_timeout_s = stall_s
            for rid in ("a", "b"):
                p.tx.bind(rid, p.rx.endpoint, p.rx.expect(rid, [1, 2], 20))
                for layer in range(L):
                    p.tx.store(rid, layer, [5, 6])
                await p.rx.wait_all(rid, 20)
                await p.tx.wait_sent(rid, 20)
                p.rx.delete(rid), p.tx.delete(rid)
                seen = len(idle_for)
                await until(lambda: any(s > idle_s for s in idle_for[seen:]),
                            f"the receiver's reads to see the link idle for {idle_s}s", hang_guard_s=30 * idle_s)
            assert p.copied([5, 6], [1, 2])
            assert p.tx.stats()["links"] == 1 and p.rx.stats()["connections"] == 1
            assert p.rx.stats()["connections_cut"] == 0
            await p.assert_clean()
    run(main())
