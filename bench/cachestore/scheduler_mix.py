"""Scheduler comparison for ``pdserve bench cachestore --mixed``: short requests behind a long one.

One long request (every layer of all but ``SHORT_REQUESTS`` blocks) is stored first, then
``SHORT_REQUESTS`` short requests (one block per layer each) are stored right behind it on
the same link. With ``fifo`` the short ones wait for the whole long transfer; with
``priority`` (MoLink) they overtake it between chunks, while the waiting weight keeps the
long one moving. Reports each short request's time to delivery and the long one's.
"""

from __future__ import annotations

import asyncio
import base64
import statistics
import time

SHORT_REQUESTS = 4


async def run_mixed(ask, read, region, layout, compat, transport: str, scheduler: str, chunk_bytes: int,
                    tag: str) -> dict:
    from pdserve.cachestore.sender import CacheStoreSender

    nb = layout.num_blocks
    if nb <= SHORT_REQUESTS:
        raise SystemExit(f"--mixed needs more than {SHORT_REQUESTS} blocks per layer")
    long_blocks = list(range(nb - SHORT_REQUESTS))
    rids = {f"{tag}-long": long_blocks, **{f"{tag}-short{i}": [nb - SHORT_REQUESTS + i] for i in range(SHORT_REQUESTS)}}
    tx = CacheStoreSender(region, layout, compat, transport=transport, scheduler=scheduler, chunk_bytes=chunk_bytes)
    await tx.start()
    try:
        info = await ask({"cmd": "expect_many", "transport": transport, "rids": rids})
        endpoint = base64.b64decode(info["endpoint"])
        for rid in rids:
            tx.bind(rid, endpoint, info["dst"][rid], bytes.fromhex(info["tokens"][rid]))
        t0 = time.perf_counter()
        for layer in range(layout.num_layers):
            tx.store(f"{tag}-long", layer, long_blocks)
        for rid, blocks in rids.items():
            if rid != f"{tag}-long":
                for layer in range(layout.num_layers):
                    tx.store(rid, layer, blocks)

        async def done(rid: str) -> float:
            await tx.wait_sent(rid, 600)
            return time.perf_counter() - t0

        times = dict(zip(rids, await asyncio.gather(*(done(r) for r in rids))))
        await read()
        for rid in rids:
            tx.delete(rid)
    finally:
        await tx.stop()
    shorts = [v for k, v in times.items() if "short" in k]
    return {"short_median_s": statistics.median(shorts), "short_max_s": max(shorts), "long_s": times[f"{tag}-long"]}
