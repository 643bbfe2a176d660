"""A CacheStore peer in its own process, for the fault tests (tests/test_cachestore_faults.py).

  python cachestore_peer.py recv TRANSPORT OUT_FILE RID BLOCKS      expect RID, write endpoint + dst to OUT_FILE
  python cachestore_peer.py send TRANSPORT IN_FILE RID BLOCKS N     bind RID, store layers 0..N-1, write IN_FILE.stored
  python cachestore_peer.py half tcp IN_FILE RID BLOCKS LAYER       raw protocol: HELLO, BIND RID, one DATA frame of
      LAYER into the (contiguous) dst blocks, but only its first half; write IN_FILE.half, wait for IN_FILE.go, send
      the rest and write IN_FILE.done (what happened). Stands for a sender frozen mid-frame.

Both then stay alive until killed. Pools use the geometry below; the sender's pool is
torch.randn with seed 0 so the test can check the bytes that arrived.
Environment: CACHESTORE_PEER_BIG=1 uses the BIG geometry (64 KiB blocks, 16 MiB pool) for
transfers that outlast the socket buffers; CACHESTORE_PEER_RCVBUF=N gives the receiver's
connections an N-byte receive buffer (a test-only poke at its listener), so a frozen receiver
stops taking data early; CACHESTORE_PEER_SECOND=BLOCKS makes the receiver also expect RID-2.
"""

import asyncio
import base64
import json
import os
import socket
import sys
import time

import torch

from pdserve.cachestore import CacheStoreReceiver, CacheStoreSender, CompatInfo, Destination, KVLayout, MemoryRegion

L, NB, BS, H, D = 4, 32, 16, 2, 8
COMPAT = CompatInfo("float32", L, H, D, BS)
LAYOUT = KVLayout(L, NB, COMPAT.block_nbytes)
BIG_NB, BIG_D = 64, 256
BIG_COMPAT = CompatInfo("float32", L, H, BIG_D, BS)
BIG_LAYOUT = KVLayout(L, BIG_NB, BIG_COMPAT.block_nbytes)


def big() -> bool:
    return os.environ.get("CACHESTORE_PEER_BIG") == "1"


def geometry(is_big: bool) -> tuple:
    """(compat, layout, pool shape)."""
    if is_big:
        return BIG_COMPAT, BIG_LAYOUT, (L, BIG_NB, 2, BS, H, BIG_D)
    return COMPAT, LAYOUT, (L, NB, 2, BS, H, D)


def source_pool(is_big: bool = False) -> torch.Tensor:
    return torch.randn(geometry(is_big)[2], generator=torch.Generator().manual_seed(0))


def endpoint_doc(endpoint: bytes, dst) -> dict:
    """What a receiver hands a sender here (the decode's Allocation, as JSON): its endpoint, the
    destination list ``expect`` returned and that list's bind token."""
    return {"endpoint": base64.b64encode(endpoint).decode(), "dst": list(dst), "dst_token": dst.token.hex()}


def destination(doc: dict, key: str = "dst") -> Destination:
    """The Destination of an ``endpoint_doc`` (``key``: "dst", or "dst2" for the second request)."""
    return Destination(doc[key], bytes.fromhex(doc[key + "_token"]))


def write_atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


async def recv(transport: str, out: str, rid: str, blocks: list[int]) -> None:
    compat, layout, shape = geometry(big())
    pool = torch.zeros(shape)
    rx = CacheStoreReceiver(MemoryRegion.from_tensor(pool), layout, compat, transport=transport)
    await rx.start()
    if os.environ.get("CACHESTORE_PEER_RCVBUF"):  # accepted connections inherit it
        rx._server._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, int(os.environ["CACHESTORE_PEER_RCVBUF"]))
    doc = endpoint_doc(rx.endpoint, rx.expect(rid, blocks, 120))
    if os.environ.get("CACHESTORE_PEER_SECOND"):  # also expect RID-2 on these blocks (a later request)
        second = rx.expect(rid + "-2", [int(b) for b in os.environ["CACHESTORE_PEER_SECOND"].split(",")], 120)
        doc.update(dst2=list(second), dst2_token=second.token.hex())
    write_atomic(out, json.dumps(doc))
    await asyncio.Event().wait()


async def send(transport: str, inp: str, rid: str, blocks: list[int], layers: int) -> None:
    compat, layout, _ = geometry(big())
    tx = CacheStoreSender(MemoryRegion.from_tensor(source_pool(big())), layout, compat, transport=transport)
    await tx.start()
    doc = json.load(open(inp))
    tx.bind(rid, base64.b64decode(doc["endpoint"]), destination(doc))
    for layer in range(layers):
        tx.store(rid, layer, blocks)
    while tx.stats()["bytes_sent"] < layers * len(blocks) * layout.block_nbytes:
        await asyncio.sleep(0.01)
    write_atomic(inp + ".stored", "ok")
    await asyncio.Event().wait()


def half(inp: str, rid: str, blocks: list[int], layer: int) -> None:
    from pdserve.cachestore.endpoint import Endpoint
    from pdserve.cachestore.frames import FrameType, encode_control, encode_header
    from pdserve.cachestore.handshake import client_hello

    compat, layout, _ = geometry(big())
    src = source_pool(big())
    doc = json.load(open(inp))
    ep = Endpoint.from_bytes(base64.b64decode(doc["endpoint"]))
    dst = doc["dst"]
    assert dst == list(range(dst[0], dst[0] + len(dst))) and blocks == list(range(blocks[0], blocks[0] + len(blocks)))
    payload = src[layer, blocks[0]:blocks[0] + len(blocks)].contiguous().numpy().tobytes()
    sock = socket.create_connection((ep.host, ep.port))
    client_hello(sock, compat, "", f"{ep.host}:{ep.port}")
    token = bytes.fromhex(doc["dst_token"])
    sock.sendall(encode_control(FrameType.BIND, rid, token=token))
    sock.sendall(encode_header(FrameType.DATA, rid, layer, dst[0], len(dst), len(payload), token=token)
                 + payload[:len(payload) // 2])
    write_atomic(inp + ".half", "ok")
    while not os.path.exists(inp + ".go"):
        time.sleep(0.01)
    try:
        sock.sendall(payload[len(payload) // 2:])
        sock.shutdown(socket.SHUT_WR)
        result = f"sent the rest; then read {sock.recv(1 << 16)!r}"
    except OSError as exc:
        result = f"sending the rest failed: {exc}"
    write_atomic(inp + ".done", result)
    time.sleep(3600)


def wait_file(path, proc, limit=60.0) -> None:
    """In the test: block until the peer process wrote ``path`` (it exited or took too long: an error)."""
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise RuntimeError(f"peer exited with {proc.returncode} (see its log)")
        if time.monotonic() > deadline:
            raise TimeoutError(f"peer did not write {path}")
        time.sleep(0.05)


if __name__ == "__main__":
    mode, transport, path, rid, blocks = sys.argv[1:6]
    block_ids = [int(b) for b in blocks.split(",")]
    if mode == "recv":
        asyncio.run(recv(transport, path, rid, block_ids))
    elif mode == "half":
        half(path, rid, block_ids, int(sys.argv[6]))
    else:
        asyncio.run(send(transport, path, rid, block_ids, int(sys.argv[6])))
