"""The CacheStore with fp8 KV pools (engine KVCache(kv_dtype="fp8"): uint8 rows of fp8 values and their
scales), in one process over both transports: layer by layer, checksummed, the receiver's gather reads what
the sender's would (the scales came with their blocks); a peer of the other KV dtype is refused, naming both."""


import pytest
import torch

from pdserve.cachestore import CacheStoreReceiver, CacheStoreSender, CompatError, CompatInfo, KVLayout, MemoryRegion
from pdserve.engine import KVCache

from harness.cachestore_pair import TRANSPORTS, run
from harness.conditions import until

L, NB, BS, H, D = 3, 12, 16, 2, 64


def _cache(kv_dtype: str, fill: bool) -> KVCache:
    kv = KVCache(L, NB, BS, H, D, torch.bfloat16, kv_dtype=kv_dtype)
    if fill:
        g = torch.Generator().manual_seed(1)
        rows = kv.slot_indices(torch.arange(NB * BS) // BS, torch.arange(NB * BS) % BS)
        for layer in range(L):
            scale = torch.logspace(-3, 3, NB * BS).view(-1, 1, 1)  # every row its own scale
            k, v = torch.randn(NB * BS, H, D, generator=g) * scale, torch.randn(NB * BS, H, D, generator=g)
            kv.write(layer, rows, k, v)
    return kv


def _ends(kv: KVCache, kv_dtype: str):
    """(CompatInfo, KVLayout, MemoryRegion) of a pool, as the servers build them (server_setup.kv_parts)."""
    compat = CompatInfo("bfloat16", L, H, D, BS, kv_dtype=kv_dtype)
    layout = KVLayout(L, NB, kv.block_nbytes)
    return compat, layout, MemoryRegion.from_tensor(kv.tensor)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fp8_blocks_move_with_their_scales_layer_by_layer_checksummed(transport):
    src, dst = _cache("fp8", True), _cache("fp8", False)

    async def main():
        compat, layout, src_region = _ends(src, "fp8")
        rx = CacheStoreReceiver(MemoryRegion.from_tensor(dst.tensor), layout, compat, transport=transport,
                                require_checksum=True)
        tx = CacheStoreSender(src_region, layout, compat, transport=transport, checksum=True)
        await rx.start()
        await tx.start()
        try:
            src_blocks, dst_blocks = [7, 2, 3, 11], [0, 5, 6, 9]
            for_sender = rx.expect("r", dst_blocks, timeout_s=20)
            tx.bind("r", rx.endpoint, for_sender)
            for layer in range(L):
                tx.store("r", layer, src_blocks)
                await rx.load("r", layer, 20)
            await rx.wait_all("r", 20)
            await tx.wait_sent("r", 20)
            rows = torch.arange(BS)
            for layer in range(L):
                for s, d in zip(src_blocks, dst_blocks):
                    assert torch.equal(dst.tensor[layer, d], src.tensor[layer, s])  # the bytes, scales included
                    want = src.gather(layer, src.slot_indices(torch.full((BS,), s), rows))
                    got = dst.gather(layer, dst.slot_indices(torch.full((BS,), d), rows))
                    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            assert rx.stats()["frames_verified"] > 0 and rx.stats()["checksum_mismatches"] == 0  # CRC32C checked
            rx.delete("r"), tx.delete("r")
            await until(lambda: rx.stats()["pinned_entries"] == tx.stats()["pinned_entries"] == 0,
                        "both ends' entries released after delete")
        finally:
            await tx.stop()
            await rx.stop()
    run(main())


def test_a_peer_of_the_other_kv_dtype_is_refused_naming_both():
    fp8, auto = _cache("fp8", False), _cache("auto", True)

    async def main():
        rx_compat = CompatInfo("bfloat16", L, H, D, BS, kv_dtype="fp8")
        tx_compat = CompatInfo("bfloat16", L, H, D, BS)
        rx = CacheStoreReceiver(MemoryRegion.from_tensor(fp8.tensor), KVLayout(L, NB, fp8.block_nbytes), rx_compat)
        tx = CacheStoreSender(MemoryRegion.from_tensor(auto.tensor), KVLayout(L, NB, auto.block_nbytes), tx_compat)
        await rx.start()
        await tx.start()
        try:
            with pytest.raises(CompatError) as info:
                tx.bind("r", rx.endpoint, [1])
            msg = str(info.value)
            assert "kv_cache=fp8(float8_e4m3fn+bfloat16 scales)" in msg and rx_compat.compat_hash in msg
            assert f"({tx_compat.describe()})" in msg and tx_compat.compat_hash in msg
        finally:
            await tx.stop()
            await rx.stop()
    run(main())
