"""A CacheStore peer killed mid-transfer (a real second process): the survivor gets TransferError
well within its timeout and frees the request; pinned entries and transfers go back to 0."""

import asyncio
import base64
import json
import sys
from pathlib import Path

import pytest
import torch

from pdserve.cachestore import CacheStoreReceiver, CacheStoreSender, MemoryRegion, TransferError

from harness import cachestore_peer as peer

PEER = peer.__file__
TIMEOUT_S = 60  # the waits' timeout; the failure must end them first (their error names the cause)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_sender_process_killed_mid_transfer(procs, tmp_path, transport):
    async def main():
        dst_pool = torch.zeros((peer.L, peer.NB, 2, peer.BS, peer.H, peer.D))
        rx = CacheStoreReceiver(MemoryRegion.from_tensor(dst_pool), peer.LAYOUT, peer.COMPAT, transport=transport)
        await rx.start()
        try:
            dst = rx.expect("r", [20, 21, 25], TIMEOUT_S)
            ep_file = tmp_path / "ep.json"
            ep_file.write_text(json.dumps(peer.endpoint_doc(rx.endpoint, dst)))
            proc = procs.start([sys.executable, PEER, "send", transport, str(ep_file), "r", "1,2,3", "2"],
                               name="sender")
            await asyncio.to_thread(peer.wait_file, Path(str(ep_file) + ".stored"), proc)
            await rx.load("r", 0, TIMEOUT_S)
            await rx.load("r", 1, TIMEOUT_S)
            src = peer.source_pool()
            assert all(torch.equal(dst_pool[l, d], src[l, s]) for l in (0, 1) for s, d in zip([1, 2, 3], [20, 21, 25]))
            waiter = asyncio.create_task(rx.wait_all("r", TIMEOUT_S))
            procs.kill(proc)
            with pytest.raises(TransferError, match="'r'") as info:
                await waiter
            # well within its timeout: the lost sender ended the wait, not TIMEOUT_S ("... within 60s")
            assert "sender connection closed" in str(info.value), info.value
            s = rx.stats()
            assert s["pinned_entries"] == 0 and s["inflight_transfers"] == 0 and s["pinned_blocks"] == 0
            rx.delete("r")
        finally:
            await rx.stop()
    asyncio.run(asyncio.wait_for(main(), 120))


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_receiver_process_killed_mid_transfer(procs, tmp_path, transport):
    async def main():
        src_pool = peer.source_pool()
        tx = CacheStoreSender(MemoryRegion.from_tensor(src_pool), peer.LAYOUT, peer.COMPAT, transport=transport)
        await tx.start()
        try:
            ep_file = tmp_path / "ep.json"
            proc = procs.start([sys.executable, PEER, "recv", transport, str(ep_file), "r", "4,5,6"], name="receiver")
            await asyncio.to_thread(peer.wait_file, ep_file, proc)
            doc = json.loads(ep_file.read_text())
            tx.bind("r", base64.b64decode(doc["endpoint"]), peer.destination(doc))
            tx.store("r", 0, [7, 8, 9])
            while tx.stats()["bytes_sent"] < 3 * peer.LAYOUT.block_nbytes:  # layer 0 delivered
                await asyncio.sleep(0.01)
            waiter = asyncio.create_task(tx.wait_sent("r", TIMEOUT_S))
            procs.kill(proc)
            for layer in range(1, peer.L):
                tx.store("r", layer, [7, 8, 9])
                await asyncio.sleep(0.05)
            with pytest.raises(TransferError, match="'r'") as info:
                await waiter
            # well within its timeout: the lost receiver failed the link, not TIMEOUT_S ("... within 60s")
            assert f"within {TIMEOUT_S}s" not in str(info.value), info.value
            s = tx.stats()
            assert s["pinned_entries"] == 0 and s["inflight_transfers"] == 0 and s["queued_chunks"] == 0
            tx.delete("r")
        finally:
            await tx.stop()
    asyncio.run(asyncio.wait_for(main(), 120))
