"""The receiving process of ``pdserve bench cachestore`` (started by transfer.py, not by users).

It allocates and touches its KV pool, then serves commands from the benchmark over one
control connection (JSON lines): ``raw_tcp`` (one big recv_into the pool), ``raw_nixl``
(register the pool with a NIXL agent, wait for one WRITE's notification), ``ours``
(CacheStoreReceiver: expect every block, wait_all, delete), ``expect_many`` (several
requests at once, for the scheduler comparison) and ``quit``. Each reply carries
the peak RSS increase during that measurement.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import sys
import time

import torch

from pdserve.cachestore.memory import CompatInfo, KVLayout, MemoryRegion

from pdserve.engine.kv_shared import shared_zeros

from .peak_rss import PeakRSS


def _wire(transport: str) -> str:
    """The CacheStore transport under a benchmark's name: samenode is tcp's control channel with the pool shared."""
    return "tcp" if transport == "samenode" else transport


async def serve(geometry: dict, control_port: int) -> None:
    compat = CompatInfo(**geometry["compat"])
    layout = KVLayout(**geometry["layout"])
    # in a memfd (what a decode server's CPU pool is, unless --kv-same-node off) so that the same-node sender can
    # map it; tcp and nixl receive into the same pages
    pool, fd = shared_zeros((layout.nbytes,), torch.uint8)
    pool.fill_(0)  # touch every page before any measurement
    region = MemoryRegion.from_tensor(pool, shared_fd=fd)
    reader, writer = await asyncio.open_connection("127.0.0.1", control_port)
    receivers: dict[str, object] = {}

    async def receiver(transport: str):
        """This process's CacheStoreReceiver of ``transport``, started on first use."""
        from pdserve.cachestore.receiver import CacheStoreReceiver

        if transport not in receivers:  # samenode: a tcp receiver offering its pool (cachestore/samenode.py)
            receivers[transport] = CacheStoreReceiver(region, layout, compat, transport=_wire(transport),
                                                      same_node=transport == "samenode")
            await receivers[transport].start()
        return receivers[transport]

    nixl_mem = None
    peak = PeakRSS()

    async def reply(doc: dict) -> None:
        writer.write((json.dumps(doc) + "\n").encode())
        await writer.drain()

    while True:
        line = await reader.readline()
        if not line:
            return
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        if cmd["cmd"] == "raw_tcp":
            lsock = socket.socket()
            lsock.bind(("127.0.0.1", 0))
            lsock.listen(1)
            await reply({"port": lsock.getsockname()[1]})
            peak.start()

            def receive() -> None:
                conn, _ = lsock.accept()
                view = region.host_view()
                got = 0
                while got < layout.nbytes:
                    n = conn.recv_into(view[got:], layout.nbytes - got, socket.MSG_WAITALL)
                    if n == 0:
                        raise RuntimeError("raw tcp sender closed early")
                    got += n
                conn.sendall(b"k")
                conn.close()

            await asyncio.to_thread(receive)
            lsock.close()
            await reply({"rss": peak.stop(), "cpu": peak.cpu_s})
        elif cmd["cmd"] == "raw_nixl":
            from pdserve.cachestore.nixl_backend import NixlMemory

            if nixl_mem is None:
                nixl_mem = NixlMemory("bench-raw-rx", region)
            await reply({"md": base64.b64encode(nixl_mem.metadata()).decode(), "addr": region.ptr})
            peak.start()
            want, got = cmd.get("notifs", 1), 0
            while got < want:
                got += sum(len(v) for v in nixl_mem.agent.get_new_notifs().values())
                await asyncio.sleep(0.0002)
            await reply({"rss": peak.stop(), "cpu": peak.cpu_s})
        elif cmd["cmd"] == "ours":
            rx = await receiver(cmd["transport"])
            rid = cmd["rid"]
            dst = rx.expect(rid, list(range(layout.num_blocks)), 600)
            peak.start()
            await reply({"endpoint": base64.b64encode(rx.endpoint).decode(), "dst": dst, "token": dst.token.hex()})
            await rx.wait_all(rid, 600)
            rss = peak.stop()
            rx.delete(rid)
            await reply({"rss": rss, "cpu": peak.cpu_s, "stats": rx.stats()})
        elif cmd["cmd"] == "expect_many":
            rx = await receiver(cmd["transport"])
            dst = {rid: rx.expect(rid, blocks, 600) for rid, blocks in cmd["rids"].items()}
            await reply({"endpoint": base64.b64encode(rx.endpoint).decode(), "dst": dst,
                         "tokens": {rid: d.token.hex() for rid, d in dst.items()}})
            await asyncio.gather(*(rx.wait_all(rid, 600) for rid in dst))
            for rid in dst:
                rx.delete(rid)
            await reply({"stats": rx.stats()})
    for rx in receivers.values():
        await rx.stop()
    if nixl_mem is not None:
        nixl_mem.close()
    writer.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    asyncio.run(serve(json.loads(sys.argv[1]), int(sys.argv[2])))
    time.sleep(0.1)
