"""The fp8 KV cache's storage (engine/kv_cache.py with kv_dtype="fp8", kv_quant.py, kv_formats.py):
rows round-trip within e4m3's rounding, a block holds its scales (its bytes alone give its values
back, wherever they are copied), the pool holds >= 1.9x the tokens of a 16-bit one in the same bytes,
and every place that counts block bytes agrees (KVCache, CompatInfo, the servers' KV sizing).
Bad input is refused with the flag's name."""

import pytest
import torch

from pdserve import defaults, kv_sizing
from pdserve.cachestore import CompatInfo
from pdserve.engine import EngineConfig, KVCache, kv_formats, kv_quant

# e4m3 keeps 3 mantissa bits: a normal value rounds within 2^-4 of itself; the row's scale
# (bfloat16, 8 bits) may put the largest value 2^-8 past 448, where it is clamped
REL, ABS_OF_AMAX = 2.0**-4, 2.0**-8


def _rows(n=300, heads=2, dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, dim, generator=g)
    x *= torch.logspace(-6, 4, n).view(n, 1, 1)  # rows of very different magnitudes, each with its own scale
    x[0] = 0.0  # an all-zero row
    x[1, 0, 3] = 1e30  # one huge outlier: only its row's scale follows it
    return x


def test_rows_round_trip_within_e4m3_rounding():
    x = _rows()
    back = kv_quant.dequantize(kv_quant.quantize(x), torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.all((back - x).abs() <= REL * x.abs() + ABS_OF_AMAX * amax + 1e-30)
    assert torch.equal(back[0], torch.zeros_like(back[0]))
    rel_rms = ((back - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30))[2:]
    assert rel_rms.max() < 0.05, rel_rms.max()  # e4m3's error, per row whatever its magnitude


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_write_gather_round_trip_and_write_returns_what_gather_reads(dtype):
    kv = KVCache(2, 6, 4, 2, 64, dtype, kv_dtype="fp8")
    assert kv.tensor.dtype == torch.uint8 and kv.tensor.shape[-1] == 64 + 2 and kv.compute_dtype == dtype
    k, v = _rows(8, seed=1)[2:].to(dtype), _rows(8, seed=2)[2:].to(dtype)
    rows = kv.slot_indices(torch.tensor([5, 5, 0, 3, 3, 3]), torch.tensor([0, 3, 1, 0, 1, 2]))
    k_stored, v_stored = kv.write(1, rows, k, v)
    k_back, v_back = kv.gather(1, rows)
    assert k_back.dtype == dtype and torch.equal(k_back, k_stored) and torch.equal(v_back, v_stored)
    for x, back in ((k, k_back), (v, v_back)):
        xf, bf = x.float(), back.float()
        tol = REL * xf.abs() + ABS_OF_AMAX * xf.abs().amax(-1, keepdim=True) + (2.0**-8) * bf.abs()  # + dtype rounding
        assert torch.all((bf - xf).abs() <= tol)
    assert kv.tensor[0].count_nonzero() == 0  # layer 0 untouched


def test_a_blocks_bytes_carry_its_scales():
    """A block copied byte for byte into another cache (what the CacheStore, tiers and swap do) reads back the same."""
    src, dst = (KVCache(1, 4, 4, 2, 64, torch.bfloat16, kv_dtype="fp8") for _ in range(2))
    k, v = _rows(4, seed=3).bfloat16(), _rows(4, seed=4).bfloat16()
    src.write(0, src.slot_indices(torch.full((4,), 2), torch.arange(4)), k, v)
    raw = bytes(src.tensor[0, 2].contiguous().view(-1).numpy())
    assert len(raw) == src.block_nbytes
    dst.tensor[0, 1].view(-1).copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    rows = torch.arange(4)
    got = dst.gather(0, dst.slot_indices(torch.full((4,), 1), rows))
    want = src.gather(0, src.slot_indices(torch.full((4,), 2), rows))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("head_dim,gain", [(64, 1.939), (128, 1.969)])
def test_fp8_holds_at_least_1_9x_the_tokens_of_bf16_in_the_same_bytes(head_dim, gain):
    bf16 = KVCache(4, 1, 16, 8, head_dim, torch.bfloat16, "meta")
    fp8 = KVCache(4, 1, 16, 8, head_dim, torch.bfloat16, "meta", kv_dtype="fp8")
    ratio = bf16.block_nbytes / fp8.block_nbytes
    assert ratio >= 1.9 and ratio == pytest.approx(gain, abs=1e-3)
    assert kv_formats.tokens_per_byte_gain(head_dim) == ratio
    # one home per fact, checked: the CacheStore's and the servers' sizing count the same bytes
    compat = CompatInfo("bfloat16", 4, 8, head_dim, 16, kv_dtype="fp8")
    assert compat.block_nbytes == fp8.block_nbytes
    assert kv_sizing.pool_bytes_per_block("bfloat16", 4, 8, head_dim, 16, "fp8") == 4 * fp8.block_nbytes
    assert kv_sizing.pool_bytes_per_block("bfloat16", 4, 8, head_dim, 16) == 4 * bf16.block_nbytes
    budget = 1 << 30  # the same bytes hold >= 1.9x the blocks, so the tokens
    assert (budget // fp8.block_nbytes) / (budget // bf16.block_nbytes) >= 1.9


def test_compat_hash_tells_fp8_apart_and_keeps_auto_as_before():
    auto = CompatInfo("bfloat16", 4, 8, 64, 16)
    assert auto.describe() == "dtype=bfloat16 layers=4 kv_heads=8 head_dim=64 block_size=16"  # hash unchanged
    fp8 = CompatInfo("bfloat16", 4, 8, 64, 16, kv_dtype="fp8")
    assert fp8.compat_hash != auto.compat_hash and "fp8" in fp8.describe()


def test_bad_kv_dtype_is_refused_naming_the_flag():
    for make in (lambda: EngineConfig(kv_cache_dtype="int4"), lambda: KVCache(1, 1, 4, 1, 8, kv_dtype="int4"),
                 lambda: CompatInfo("float32", 1, 1, 8, 4, kv_dtype="int4")):
        with pytest.raises(ValueError, match="int4"):
            make()
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, fp8"):
        EngineConfig(kv_cache_dtype="fp16")


def test_up_gives_every_server_its_kv_cache_dtype(tmp_path):
    """``pdserve up --kv-cache-dtype fp8`` starts every prefill and decode with it (they must agree); up may not
    import the engine (the import arrows): it reads the choices from pdserve.defaults, as the servers do."""
    import argparse

    from pdserve.localcluster import up_args
    from pdserve.localcluster.up import LocalCluster
    from pdserve.server_setup import add_engine_arguments

    assert defaults.KV_CACHE_DTYPES == kv_formats.KV_DTYPES
    parser = argparse.ArgumentParser()
    up_args.add_arguments(parser)
    cluster = LocalCluster(parser.parse_args(["--kv-cache-dtype", "fp8", "--log-dir", str(tmp_path)]), say=print)
    servers = cluster.supervisor.servers
    assert sorted(s.role for s in servers) == ["decode", "decode", "prefill"]
    server_flags = argparse.ArgumentParser()
    add_engine_arguments(server_flags)
    for server in servers:
        i = server.argv.index("--kv-cache-dtype")
        assert server_flags.parse_known_args(server.argv[i : i + 2])[0].kv_cache_dtype == "fp8"


def test_a_server_engine_with_fp8_kv_gets_the_blocks_its_byte_budget_holds(caplog):
    """The servers' start-up path (--kv-cache-memory with --kv-cache-dtype fp8): the pool tensor is the budget,
    in fp8 blocks (the tiny model's float32 K/V: 64 bytes per row, 18 in fp8)."""
    import argparse

    from pdserve.server_setup import add_engine_arguments, load_engine

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    blocks = {}
    for kv_dtype in ("auto", "fp8"):
        args = parser.parse_args(["--model", "tiny", "--kv-cache-memory", "4MiB", "--kv-cache-dtype", kv_dtype])
        with caplog.at_level("INFO", logger="pdserve.server"):
            engine = load_engine(args)[1]
        blocks[kv_dtype] = engine.num_blocks
        assert engine.kv_cache.kv_dtype == kv_dtype and engine.kv_cache.tensor.nbytes <= 4 << 20
    assert blocks == {"auto": 64, "fp8": (4 << 20) // (4 * 2 * 64 * 2 * 18)}
    assert any("fp8 (float8_e4m3fn" in r.message and f"{blocks['fp8']} blocks" in r.message for r in caplog.records)


def test_the_kv_pool_lender_stores_fp8_and_attends_over_what_it_holds(tiny):
    """The KV pool's PutKV writes through KVCache (quantized into the lent blocks), Attend reads them back:
    the micro-attention over the fp8 round trip of the K/V put; fp8 and auto peers refuse each other."""
    import threading

    from pdserve.engine import LLMEngine
    from pdserve.kvpool.attention import from_bytes, micro_attention
    from pdserve.kvpool.rmanager import BlockLender, kv_layout
    from pdserve.protos import KVPOOL_VERSION, kvpool_pb2

    engine = LLMEngine(tiny, EngineConfig(num_blocks=6, block_size=16, kv_cache_dtype="fp8"))
    auto = LLMEngine(tiny, EngineConfig(num_blocks=1, block_size=16))
    assert kv_layout(engine) == kv_layout(auto) + "/fp8"
    lender = BlockLender(engine, threading.Lock(), reserve=0, idle_s=60.0)
    refused = lender.Lend(kvpool_pb2.LendRequest(borrower="b", request_id="x", blocks=1, layout=kv_layout(auto),
                                                 version=KVPOOL_VERSION), None)
    assert refused.granted_blocks == 0 and "incompatible peer" in refused.refusal
    assert lender.Lend(kvpool_pb2.LendRequest(borrower="b", request_id="r", blocks=4, layout=lender.layout,
                                              version=KVPOOL_VERSION), None).granted_blocks == 4
    cfg = engine.model_config
    g = torch.Generator().manual_seed(5)
    k, v = (torch.randn(50, cfg.num_kv_heads, cfg.head_dim, generator=g) for _ in range(2))
    lender.PutKV(kvpool_pb2.PutKVRequest(request_id="r", layer=1, start=0, num_tokens=50,
                                         k=k.numpy().tobytes(), v=v.numpy().tobytes()), None)
    q = torch.randn(cfg.num_heads, cfg.head_dim, generator=g)
    r = lender.Attend(kvpool_pb2.AttendRequest(request_id="r", layer=1, q=q.numpy().tobytes(),
                                               num_heads=cfg.num_heads), None)
    got = from_bytes(r.max, r.sum_exp, r.weighted, cfg.num_heads)
    rt = [kv_quant.dequantize(kv_quant.quantize(x), torch.float32) for x in (k, v)]
    want = micro_attention(q, *rt)
    for a, b in ((got.max, want.max), (got.sum_exp, want.sum_exp), (got.weighted, want.weighted)):
        torch.testing.assert_close(a, b)
    assert lender.Release(kvpool_pb2.ReleaseRequest(request_id="r"), None).freed_blocks == 4
    assert engine.num_free_blocks() == 6 and engine.num_requests() == 0


def test_on_cuda_an_fp8_cache_takes_the_torch_attention_path(monkeypatch):
    """The paged Triton kernels read 16/32-bit rows: an fp8 cache on CUDA is not theirs (the engine gathers and
    dequantizes in torch instead, correct but slower, and logs so)."""
    from types import SimpleNamespace

    from pdserve.engine import gpu_attention

    monkeypatch.setattr(gpu_attention, "available", lambda: True)
    cache = SimpleNamespace(device=torch.device("cuda"), block_size=16, head_dim=64, fp8=False)
    assert gpu_attention.usable(cache)
    cache.fp8 = True
    assert not gpu_attention.usable(cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizing_what_a_row_dequantizes_to_gives_the_same_bytes(dtype):
    """Values that came out of an fp8 row go back into the same bytes (the KV pool's borrower attends over the
    round trip and sends it to lenders that quantize it again)."""
    rows = kv_quant.quantize(_rows(seed=7)[2:].to(dtype))
    assert torch.equal(kv_quant.quantize(kv_quant.dequantize(rows, dtype)), rows)


def test_the_cachestores_copy_of_the_kv_formats_is_the_engines():
    """The cachestore imports nothing of the engine (the import arrows), so it holds its own copy of the KV
    dtypes and the fp8 row's scale bytes: they must be the engine's."""
    from pdserve.cachestore import memory

    assert memory.KV_DTYPES == kv_formats.KV_DTYPES == defaults.KV_CACHE_DTYPES
    assert memory.FP8_SCALE_BYTES == kv_formats.SCALE_BYTES
