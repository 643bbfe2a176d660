"""A CacheStore peer frozen (SIGSTOP: alive, connections open, silent) mid-transfer, in its own
process. Whatever the survivor holds for that peer is bounded by a stall timeout, not by the
peer waking up:

* a frozen receiver: the sender's link fails after ``stall_timeout_s`` without progress, so
  its pins and its sending threads go back to 0 and later requests get a new link;
* a sender frozen mid-frame (tcp): once the decode deleted (or timed out) the entry, the
  receiver closes that connection after ``stall_timeout_s`` without a byte, ``released`` returns,
  and when the sender wakes up no byte of the frame lands in the (reused) blocks.
"""

import asyncio
import base64
import json
import logging
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from pdserve.cachestore import CacheStoreReceiver, CacheStoreSender, MemoryRegion, TransferError

from harness import cachestore_peer as peer
from harness.conditions import until

PEER = peer.__file__
STALL_S = 2.0     # the stall bound the tests configure
HANG_GUARD_S = 10 * STALL_S  # only a hang guard: what ended a wait is asserted from the stats and logs


async def _until(cond, limit: float, what: str) -> None:
    await until(cond, what, hang_guard_s=limit, pause_s=0.05)


def _stopped(pid: int) -> bool:
    """Every thread of pid is stopped (state T in /proc): the freeze has taken effect."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            continue  # a thread that just ended
    return bool(states) and all(st in ("T", "t") for st in states)


async def _freeze(pid: int) -> None:
    """SIGSTOP pid's group and wait until all its threads are stopped: what the test does next
    (store more layers, delete) happens against a peer that certainly runs no more code. A CI run
    once saw a receiver acknowledge a whole layer stored after the SIGSTOP had been sent."""
    os.killpg(pid, signal.SIGSTOP)
    await _until(lambda: _stopped(pid), HANG_GUARD_S, f"process {pid} stopped by SIGSTOP")


def _blocks(a: int, b: int) -> str:
    return ",".join(str(i) for i in range(a, b))


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_receiver_frozen_mid_transfer_frees_the_link(procs, tmp_path, transport, monkeypatch, caplog):
    """SIGSTOP the receiver mid-transfer of a 10 MiB request: the request fails at its timeout,
    and the link fails too, by its stall bound (its warning names it; sending_chunks back to 0,
    sockets closed) while the receiver is still frozen; a fresh receiver, and the same one after
    SIGCONT, then serve later requests."""
    caplog.set_level(logging.WARNING, logger="pdserve.cachestore.link")
    env = {"CACHESTORE_PEER_BIG": "1", "CACHESTORE_PEER_RCVBUF": "65536", "CACHESTORE_PEER_SECOND": _blocks(40, 64)}
    if transport == "nixl":
        # UCX's shared-memory transports let a sender finish a WRITE into a frozen receiver's memory
        # on its own (nothing stalls, sometimes); over its TCP transport the receiver must take
        # part, as between machines, so the freeze stalls the link every time.
        env["UCX_TLS"] = "tcp"
        monkeypatch.setenv("UCX_TLS", "tcp")

    async def main():
        src = peer.source_pool(True)
        tx = CacheStoreSender(MemoryRegion.from_tensor(src), peer.BIG_LAYOUT, peer.BIG_COMPAT, transport=transport,
                              stall_timeout_s=STALL_S)
        await tx.start()
        try:
            ep_file = tmp_path / "ep.json"
            frozen = procs.start([sys.executable, PEER, "recv", transport, str(ep_file), "r", _blocks(0, 40)],
                                 name="receiver", env=env)
            await asyncio.to_thread(peer.wait_file, ep_file, frozen)
            doc = json.loads(ep_file.read_text())
            endpoint = base64.b64decode(doc["endpoint"])
            tx.bind("r", endpoint, peer.destination(doc))
            tx.store("r", 0, list(range(40)))
            await _until(lambda: tx.stats()["bytes_sent"] > 0, 30, "first bytes delivered")
            await _freeze(frozen.pid)
            at_stop = tx.stats()
            for layer in range(1, peer.L):
                tx.store("r", layer, list(range(40)))
            with pytest.raises(TransferError, match="'r'") as gave_up:
                await tx.wait_sent("r", STALL_S * 3)  # stands for the session timeout
            at_give_up = tx.stats()
            state = [l for l in open(f"/proc/{frozen.pid}/status") if l.startswith("State")]
            tx.delete("r")

            def link_failures() -> list[str]:
                return [r.getMessage() for r in caplog.records if "CacheStore link to" in r.getMessage()]

            try:
                await _until(lambda: tx.stats()["sending_chunks"] == 0 and tx.stats()["links"] == 0, HANG_GUARD_S,
                             "the stalled link failed")
            except AssertionError as e:  # say what the sender holds and which links failed, and why
                raise AssertionError(f"{e}; sender stats {tx.stats()}; link failures {link_failures()}; at SIGSTOP "
                                     f"{at_stop}; when wait_sent gave up ({gave_up.value}) "
                                     f"{at_give_up}, the receiver {state}") from None
            # by the stall bound (the receiver never woke up meanwhile), not by a connection error
            failures = link_failures()
            assert any(f"made no progress for {STALL_S}s" in m for m in failures), failures
            s = tx.stats()
            assert s["pinned_entries"] == 0 and s["inflight_transfers"] == 0 and s["queued_chunks"] == 0, s

            # a fresh receiver gets a working link while the first one is still frozen
            ep2 = tmp_path / "ep2.json"
            fresh = procs.start([sys.executable, PEER, "recv", transport, str(ep2), "f", _blocks(0, 40)],
                                name="fresh", env=env)
            await asyncio.to_thread(peer.wait_file, ep2, fresh)
            doc2 = json.loads(ep2.read_text())
            tx.bind("f", base64.b64decode(doc2["endpoint"]), peer.destination(doc2))
            for layer in range(peer.L):
                tx.store("f", layer, list(range(40)))
            await tx.wait_sent("f", 60)
            tx.delete("f")

            # the frozen one, woken up, is reconnected for its next request
            os.killpg(frozen.pid, signal.SIGCONT)
            tx.bind("r-2", endpoint, peer.destination(doc, "dst2"))
            for layer in range(peer.L):
                tx.store("r-2", layer, list(range(40, 64)))
            await tx.wait_sent("r-2", 60)
            tx.delete("r-2")
            # the receiver's ACK can overtake the writer thread's own bookkeeping of its last chunk
            # (tcp: another thread reads ACKs), so sending_chunks reaches 0 a moment after wait_sent
            await _until(lambda: tx.stats()["sending_chunks"] == 0, HANG_GUARD_S, "the last chunk's bookkeeping")
            s = tx.stats()
            assert s["pinned_entries"] == 0 and s["sending_chunks"] == 0 and s["queued_chunks"] == 0, s
        finally:
            await tx.stop()
    asyncio.run(asyncio.wait_for(main(), 240))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["delete", "timeout"])
def test_sender_frozen_mid_frame_is_cut(procs, tmp_path, how):
    """tcp: a sender SIGSTOPped half-way through a 2.5 MiB DATA frame. Once the decode deletes
    the entry (or it times out), the receiver closes that connection within the stall bound and
    ``released`` returns; the blocks are then reused (a pattern written into them), and after
    SIGCONT the rest of the frame is refused: the pattern is intact."""
    async def main():
        dst_pool = torch.zeros(peer.geometry(True)[2])
        rx = CacheStoreReceiver(MemoryRegion.from_tensor(dst_pool), peer.BIG_LAYOUT, peer.BIG_COMPAT, transport="tcp",
                                stall_timeout_s=STALL_S)
        await rx.start()
        try:
            dst = list(range(10, 50))
            # "timeout": the entry's own expiry, long enough for the sender process to start on a
            # loaded box (a 3 s expiry sometimes ran out before its first byte was sent)
            sent = rx.expect("h", dst, 20.0 if how == "timeout" else 60)
            ep_file = tmp_path / "ep.json"
            ep_file.write_text(json.dumps(peer.endpoint_doc(rx.endpoint, sent)))
            proc = procs.start([sys.executable, PEER, "half", "tcp", str(ep_file), "h", _blocks(0, 40), "1"],
                               name="sender", env={"CACHESTORE_PEER_BIG": "1"})
            await asyncio.to_thread(peer.wait_file, Path(f"{ep_file}.half"), proc)
            await _freeze(proc.pid)
            await _until(lambda: rx.stats()["receiving_frames"] == 1, 10, "the frame is being received")
            if how == "delete":
                rx.delete("h")
            else:
                with pytest.raises(TransferError):
                    await rx.wait_all("h", 60)
                rx.delete("h")
            # the sender is still frozen: only the receiver's stall bound can end the frame (connections_cut)
            await rx.released("h", HANG_GUARD_S)
            s = rx.stats()
            assert s["connections_cut"] == 1 and s["connections"] == 0, s
            assert s["pinned_entries"] == 0 and s["receiving_frames"] == 0 and s["pinned_blocks"] == 0, s

            dst_pool[:, 10:50] = 7.0  # the blocks now belong to another request
            Path(f"{ep_file}.go").write_text("go")
            os.killpg(proc.pid, signal.SIGCONT)
            # the sender has sent (or failed to send) the rest of the frame: nothing can land after
            # this, since the receiver shut the connection before ``released`` returned and no thread
            # reads from it any more (connections == 0): what is in the blocks now is what stays
            await asyncio.to_thread(peer.wait_file, Path(f"{ep_file}.done"), proc)
            assert torch.all(dst_pool[:, 10:50] == 7.0), "a byte of the cut frame landed in freed blocks"
            s = rx.stats()
            assert s["frames_received"] == 0 and s["connections"] == 0 and s["connections_cut"] == 1, s
        finally:
            await rx.stop()
    asyncio.run(asyncio.wait_for(main(), 120))
