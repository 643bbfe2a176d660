"""engine/native.py: the C++ decode attention over the paged cache in place gives SDPA's result over the
gathered context, refuses bad tables with an error naming them, and the engine falls back to its torch path
(with the reason) where the kernel cannot be built. Built with g++ here; skipped only on a machine without one."""

import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from harness.isa_levels import ISA_LEVELS, namespace, needs_compiler
from pdserve.engine import kv_quant, native
from pdserve.engine.kv_cache import KVCache



def _op(level):
    if level == "native":
        op = native.paged_decode_attention()
        assert op is not None, native.unavailable_reason()
        return op
    return native.build_variant(namespace("pdserve_native", level), march=level)


def _case(batch_ctx, heads, kv_heads, dim, block_size, dtype, seed=0):
    """A cache with each sequence's blocks scattered over the layer, its q, tables, context ends."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-c // block_size) for c in batch_ctx)
    kv = KVCache(1, len(batch_ctx) * max_blocks + 3, block_size, kv_heads, dim, dtype)
    kv.tensor.copy_(torch.randn(kv.tensor.shape, generator=g).to(dtype))
    perm = torch.randperm(kv.num_blocks, generator=g)[: len(batch_ctx) * max_blocks]
    tables = perm.view(len(batch_ctx), max_blocks).contiguous()
    q = torch.randn(len(batch_ctx), heads, dim, generator=g).to(dtype)
    return kv, q, tables, torch.tensor(batch_ctx)


def _reference(kv, q, tables, starts, ends, scale, dtype=torch.float32):
    """SDPA in float32 (or dtype) over the gathered context (KVCache.gather), masked to start <= p < end."""
    rows = kv.table_rows(tables)
    k, v = kv.gather(0, rows)
    pos = torch.arange(rows.shape[1])
    mask = ((pos >= starts.unsqueeze(1)) & (pos < ends.unsqueeze(1))).view(len(ends), 1, 1, -1)
    return F.scaled_dot_product_attention(q.to(dtype).unsqueeze(2), k.to(dtype).transpose(1, 2),
                                          v.to(dtype).transpose(1, 2),
                                          attn_mask=mask, scale=scale, enable_gqa=True).squeeze(2)


@needs_compiler
@pytest.mark.parametrize("heads,kv_heads,dim",
                         [(16, 2, 64), (16, 8, 64), (4, 4, 128), (6, 1, 32), (4, 2, 16), (2, 1, 256)])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("level", ISA_LEVELS)
def test_kernel_matches_sdpa_over_the_gathered_context(heads, kv_heads, dim, block_size, window, level):
    op = _op(level)
    kv, q, tables, ends = _case([150, 1, 64, 97], heads, kv_heads, dim, block_size, torch.float32)
    starts = torch.zeros_like(ends) if window is None else (ends - window).clamp(min=0)
    got = op(q, kv.layer(0), tables, starts, ends, 0.2)
    torch.testing.assert_close(got, _reference(kv, q, tables, starts, ends, 0.2), atol=1e-5, rtol=1e-5)
    # slots past a sequence's end (the rest of its last block, other sequences' blocks) change nothing
    kv.tensor[0, tables[1, 0], :, 1:] = 1e4
    torch.testing.assert_close(op(q, kv.layer(0), tables, starts, ends, 0.2), got)


@needs_compiler
@pytest.mark.parametrize("level", ISA_LEVELS)
def test_scores_far_apart_soft_max_like_sdpa(level):
    """A large scale spreads the scores over hundreds: 93% of the softmax terms of the longest
    sequence fall below e^-80 (the kernel's vectorized exp gives 0 there) and the result is still
    SDPA's in float64. The tolerance is 5e-5: the kernel's float32 scores of up to 255 are rounded
    by ~1e-5 of that, and exp carries it into the weights (the kernel before the vectorized exp
    was 2.7e-5 off float32 SDPA here, the same as now)."""
    op = _op(level)
    kv, q, tables, ends = _case([300, 17, 33], 16, 2, 64, 16, torch.float32, seed=3)
    starts = torch.zeros_like(ends)
    got = op(q, kv.layer(0), tables, starts, ends, 8.0)
    kv64 = KVCache(1, kv.num_blocks, 16, 2, 64, torch.float64)
    kv64.tensor.copy_(kv.tensor)
    want = _reference(kv64, q.double(), tables, starts, ends, 8.0, torch.float64).float()
    torch.testing.assert_close(got, want, atol=5e-5, rtol=5e-5)


@needs_compiler
@pytest.mark.parametrize("level", ISA_LEVELS)
def test_bfloat16_is_the_float32_arithmetic_rounded_once(level):
    op = _op(level)
    kv, q, tables, ends = _case([130, 7, 64], 16, 2, 64, 64, torch.bfloat16, seed=3)
    starts = torch.zeros_like(ends)
    got = op(q, kv.layer(0), tables, starts, ends, 0.125)
    assert got.dtype == torch.bfloat16
    want = _reference(kv, q, tables, starts, ends, 0.125)  # the same bf16 inputs, all in float32
    torch.testing.assert_close(got.float(), want, atol=0, rtol=2**-8)  # within bf16's rounding of the result


@needs_compiler
def test_bad_tables_and_positions_are_refused_with_the_reason():
    op = native.paged_decode_attention()
    kv, q, tables, ends = _case([40, 10], 4, 2, 16, 16, torch.float32)
    starts = torch.zeros_like(ends)
    with pytest.raises(RuntimeError, match="outside its block table"):
        op(q, kv.layer(0), tables, starts, torch.tensor([40, 10 + 16 * tables.shape[1]]), 1.0)
    bad = tables.clone()
    bad[0, 0] = kv.num_blocks
    with pytest.raises(RuntimeError, match="block id outside the layer"):
        op(q, kv.layer(0), bad, starts, ends, 1.0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        op(q.double(), kv.layer(0), tables, starts, ends, 1.0)


@needs_compiler
def test_the_head_sizes_the_engine_offers_it_are_the_ones_it_has():
    op = native.paged_decode_attention()
    for dim in (*native.HEAD_DIMS, 80):
        kv, q, tables, ends = _case([5], 2, 1, dim, 16, torch.float32)
        if dim in native.HEAD_DIMS:
            want = _reference(kv, q, tables, torch.zeros_like(ends), ends, 0.5)
            got = op(q, kv.layer(0), tables, torch.zeros_like(ends), ends, 0.5)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:  # the model uses its torch path for these (DecoderModel._native_decode)
            with pytest.raises(RuntimeError, match="head_dim 80"):
                op(q, kv.layer(0), tables, torch.zeros_like(ends), ends, 0.5)


def test_without_a_compiler_the_build_names_the_cause(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        native.build()


def test_the_engine_falls_back_to_its_torch_path_with_the_reason(tmp_path):
    """A process whose kernels cannot be built (no compiler, empty cache) generates the same greedy tokens."""
    code = ("import torch; from pdserve.engine import native, load_model, LLMEngine, EngineConfig, SamplingParams\n"
            "e = LLMEngine(load_model('tiny'), EngineConfig(num_blocks=64, block_size=16, max_num_seqs=2))\n"
            "e.add_request('a', list(range(40)), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))\n"
            "out = []\n"
            "while e.has_unfinished():\n"
            "    out += [t for o in e.step() for t in o.new_token_ids]\n"
            "print(native.unavailable_reason()); print(out)\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # an empty cache: ~/.cache/pdserve under tmp_path
    runs = {}
    for name, extra in {"torch": {"CXX": "/nonexistent/g++"}, "native": {}}.items():
        done = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
        runs[name] = (*done.stdout.splitlines(), done.stderr)
    assert runs["torch"][0].startswith("no C++ compiler") and "using the torch path" in runs["torch"][2]
    if shutil.which("g++"):
        assert runs["native"][0] == "None"  # built into the empty cache, and used
    assert runs["native"][1] == runs["torch"][1]


# ---- an fp8 cache (kv_dtype="fp8": rows of head_dim float8_e4m3fn bytes + a bfloat16 scale, kv_quant.py) ----

def _fp8_case(batch_ctx, heads, kv_heads, dim, block_size, q_dtype, seed=0):
    """An fp8 cache written through KVCache.write (values of many magnitudes, a scale per row), scattered blocks."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-c // block_size) for c in batch_ctx)
    kv = KVCache(1, len(batch_ctx) * max_blocks + 3, block_size, kv_heads, dim, q_dtype, kv_dtype="fp8")
    n = kv.num_blocks * block_size
    rows = kv.slot_indices(torch.arange(n) // block_size, torch.arange(n) % block_size)
    magnitude = torch.logspace(-1, 1, n).view(n, 1, 1)
    k, v = torch.randn(n, kv_heads, dim, generator=g) * magnitude, torch.randn(n, kv_heads, dim, generator=g)
    kv.write(0, rows, k, v)
    perm = torch.randperm(kv.num_blocks, generator=g)[: len(batch_ctx) * max_blocks]
    tables = perm.view(len(batch_ctx), max_blocks).contiguous()
    return kv, torch.randn(len(batch_ctx), heads, dim, generator=g).to(q_dtype), tables, torch.tensor(batch_ctx)


def _fp8_reference(kv, q, tables, starts, ends, scale):
    """SDPA in float32 over the rows dequantized in float32 (kv_quant.dequantize: the torch path's arithmetic)."""
    rows = kv.table_rows(tables)
    flat = kv.flat_layer(0)
    shape = (*rows.shape, kv.num_kv_heads, kv.head_dim)
    k = kv_quant.dequantize(flat[rows.reshape(-1)], torch.float32).view(shape)
    v = kv_quant.dequantize(flat[rows.reshape(-1) + kv.block_size], torch.float32).view(shape)
    pos = torch.arange(rows.shape[1])
    mask = ((pos >= starts.unsqueeze(1)) & (pos < ends.unsqueeze(1))).view(len(ends), 1, 1, -1)
    return F.scaled_dot_product_attention(q.float().unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=mask, scale=scale, enable_gqa=True).squeeze(2)


@needs_compiler
@pytest.mark.parametrize("heads,kv_heads,dim", [(16, 2, 64), (4, 4, 128), (6, 1, 32), (4, 2, 16), (2, 1, 256)])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("level", ISA_LEVELS)
def test_fp8_cache_matches_sdpa_over_its_dequantized_rows(heads, kv_heads, dim, q_dtype, window, level):
    op = _op(level)
    kv, q, tables, ends = _fp8_case([150, 1, 64, 97], heads, kv_heads, dim, 16, q_dtype)
    starts = torch.zeros_like(ends) if window is None else (ends - window).clamp(min=0)
    got = op(q, kv.layer(0), tables, starts, ends, 0.2)
    assert got.dtype == q_dtype
    want = _fp8_reference(kv, q, tables, starts, ends, 0.2)
    if q_dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # within bf16's rounding of the result
        torch.testing.assert_close(got.float(), want, atol=1e-6, rtol=2**-8)


@needs_compiler
@pytest.mark.parametrize("level", ISA_LEVELS)
def test_every_fp8_byte_widens_to_its_value(level):
    """One token per sequence: the output is its V row, so each of the 254 finite e4m3fn bytes (subnormals and
    negatives included) must come out as torch's float8_e4m3fn value of it, times the row's scale."""
    op = _op(level)
    kv = KVCache(1, 4, 16, 1, 64, torch.float32, kv_dtype="fp8")
    finite = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)] + [0, 0], dtype=torch.uint8).view(4, 64)
    for seq in range(4):
        kv.tensor[0, seq, 1, 0, 0, :64] = finite[seq]  # V of token 0 of block `seq`
        kv.tensor[0, seq, 1, 0, 0, 64:] = torch.tensor([0.75], dtype=torch.bfloat16).view(torch.uint8)
    one = torch.ones(4, dtype=torch.long)
    got = op(torch.randn(4, 1, 64), kv.layer(0), torch.arange(4).view(4, 1), torch.zeros_like(one), one, 1.0)
    want = finite.view(torch.float8_e4m3fn).float() * 0.75
    assert torch.equal(got.view(4, 64), want)


@needs_compiler
def test_an_fp8_cache_with_the_wrong_row_size_is_refused():
    op = native.paged_decode_attention()
    kv, q, tables, ends = _fp8_case([20], 4, 2, 16, 16, torch.float32)
    with pytest.raises(RuntimeError, match="head_dim \\+ 2 bytes"):
        op(q[..., :8].contiguous(), kv.layer(0), tables, torch.zeros_like(ends), ends, 1.0)


@needs_compiler
def test_the_engine_switch_picks_the_attention_once():
    """EngineConfig.native_kernels: the runner picks "native" (the C++ decode kernel) or "torch" at start; the
    tokens are the same either way."""
    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, load_model
    from harness.engine_runs import run_all

    loaded = load_model("tiny")
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    requests = {f"r{i}": ([5 + i, 9, 40, 3, 7] * (i + 1), sp) for i in range(3)}
    runs = {}
    for on in (True, False):
        engine = LLMEngine(loaded, EngineConfig(num_blocks=32, block_size=16, native_kernels=on))
        assert engine.runner.attention == ("native" if on else "torch")
        runs[on] = run_all(engine, requests)
    assert runs[True] == runs[False]
