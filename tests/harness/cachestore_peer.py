"""A CacheStore peer in its own process, for the fault tests (tests/test_cachestore_faults.py).

  python cachestore_peer.py recv TRANSPORT OUT_FILE RID BLOCKS      expect RID, write endpoint + dst to OUT_FILE
  python cachestore_peer.py send TRANSPORT IN_FILE RID BLOCKS N     bind RID, store layers 0..N-1, write IN_FILE.stored

Both then stay alive until killed. Pools use the geometry below; the sender's pool is
torch.randn with seed 0 so the test can check the bytes that arrived.
"""

import asyncio
import base64
import json
import os
import sys

import torch

from pdserve.cachestore import CacheStoreReceiver, CacheStoreSender, CompatInfo, KVLayout, MemoryRegion

L, NB, BS, H, D = 4, 32, 16, 2, 8
COMPAT = CompatInfo("float32", L, H, D, BS)
LAYOUT = KVLayout(L, NB, COMPAT.block_nbytes)


def source_pool() -> torch.Tensor:
    return torch.randn((L, NB, 2, BS, H, D), generator=torch.Generator().manual_seed(0))


def write_atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


async def recv(transport: str, out: str, rid: str, blocks: list[int]) -> None:
    pool = torch.zeros((L, NB, 2, BS, H, D))
    rx = CacheStoreReceiver(MemoryRegion.from_tensor(pool), LAYOUT, COMPAT, transport=transport)
    await rx.start()
    dst = rx.expect(rid, blocks, 120)
    write_atomic(out, json.dumps({"endpoint": base64.b64encode(rx.endpoint).decode(), "dst": dst}))
    await asyncio.Event().wait()


async def send(transport: str, inp: str, rid: str, blocks: list[int], layers: int) -> None:
    tx = CacheStoreSender(MemoryRegion.from_tensor(source_pool()), LAYOUT, COMPAT, transport=transport)
    await tx.start()
    doc = json.load(open(inp))
    tx.bind(rid, base64.b64decode(doc["endpoint"]), doc["dst"])
    for layer in range(layers):
        tx.store(rid, layer, blocks)
    while tx.stats()["bytes_sent"] < layers * len(blocks) * LAYOUT.block_nbytes:
        await asyncio.sleep(0.01)
    write_atomic(inp + ".stored", "ok")
    await asyncio.Event().wait()


if __name__ == "__main__":
    mode, transport, path, rid, blocks = sys.argv[1:6]
    block_ids = [int(b) for b in blocks.split(",")]
    if mode == "recv":
        asyncio.run(recv(transport, path, rid, block_ids))
    else:
        asyncio.run(send(transport, path, rid, block_ids, int(sys.argv[6])))
