"""engine/gpu_attention.py: the Triton decode and prefill kernels over the paged cache in place give plain
torch attention over the gathered context (float32; causal and sliding-window masks, tanh soft-capping, GQA),
for head sizes that are not powers of two, shuffled block tables and ragged lengths.

Run here on CPU tensors: the module decorates its kernels for Triton's interpreter on its own (no
TRITON_INTERPRET in the environment), the same bodies it compiles for CUDA tensors. triton is part of the
test environment (it comes with torch's CUDA wheels), so a missing triton fails these tests, never skips
them. Shapes stay small: the interpreter runs every program in numpy."""

import os
import sys

import pytest
import torch

from pdserve.engine import gpu_attention, triton_jit
from pdserve.engine.kv_cache import KVCache

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True, scope="module")
def _triton_present():
    assert gpu_attention.available(), "triton does not import in the test environment"


def _cache(contexts: list[int], kv_heads: int, dim: int, block_size: int, dtype, g: torch.Generator):
    """A one-layer cache with random K/V and each sequence's blocks scattered over it (tables ``[S, nb]``,
    padded with block 0). Slots no context covers hold NaN: a kernel that reads past an end fails loudly."""
    width = max(-(-c // block_size) for c in contexts)
    needed = sum(-(-c // block_size) for c in contexts)
    kv = KVCache(1, needed + 3, block_size, kv_heads, dim, dtype)
    kv.tensor.copy_(torch.randn(kv.tensor.shape, generator=g).to(dtype))
    perm = torch.randperm(kv.num_blocks, generator=g).tolist()
    tables = torch.zeros(len(contexts), width, dtype=torch.int64)
    for s, c in enumerate(contexts):
        n = -(-c // block_size)
        tables[s, :n] = torch.tensor(perm[:n])
        perm = perm[n:]
        last, used = tables[s, n - 1], c - (n - 1) * block_size
        kv.layer(0)[last, :, used:] = float("nan")  # the rest of the last block
    for spare in perm:
        kv.layer(0)[spare] = float("nan")
    return kv, tables


def _context(kv: KVCache, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[length, KVH, D]`` (float32) of one sequence, gathered from its table."""
    layer = kv.layer(0)[table]  # [nb, 2, block, KVH, D]
    k = layer[:, 0].reshape(-1, kv.num_kv_heads, kv.head_dim)[:length]
    v = layer[:, 1].reshape(-1, kv.num_kv_heads, kv.head_dim)[:length]
    return k.float(), v.float()


def _reference(q, k, v, qpos, first, scale, softcap):
    """Rows q ``[n, H, D]`` at positions ``qpos`` [n], each seeing keys ``first[i] <= j <= qpos[i]`` of k/v
    ``[L, KVH, D]`` -> ``[n, H, D]`` float32 (matmul, soft-cap, mask, softmax)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    kpos = torch.arange(k.shape[0])
    seen = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] >= first[:, None])
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    return torch.einsum("hnl,lhd->nhd", probs, v)


def _decode_reference(kv, q, tables, starts, ends, scale, softcap):
    rows = []
    for b, (start, end) in enumerate(zip(starts.tolist(), ends.tolist())):
        k, v = _context(kv, tables[b], end)
        rows.append(_reference(q[b : b + 1], k, v, torch.tensor([end - 1]), torch.tensor([start]), scale, softcap))
    return torch.cat(rows)


DECODE_CASES = [  # heads, kv_heads, dim, block_size, window, softcap, num_splits (None: the kernel's choice)
    (2, 2, 64, 16, None, None, 3),
    (4, 2, 80, 16, 20, None, 3),
    (4, 1, 64, 64, None, 30.0, None),
    (8, 1, 80, 64, None, 2.0, 2),
    (8, 2, 64, 16, 50, 10.0, 4),
]
# one 1-token context and one longer than a partition (several splits) per block size
DECODE_ENDS = {16: [1, 37, 150, 70], 64: [1, 37, 300, 128]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim,block_size,window,softcap,splits", DECODE_CASES)
def test_decode_matches_torch_over_the_gathered_context(heads, kv_heads, dim, block_size, window, softcap, splits,
                                                        dtype):
    g = torch.Generator().manual_seed(heads * 1000 + dim + block_size)
    ends = torch.tensor(DECODE_ENDS[block_size])
    kv, tables = _cache(ends.tolist(), kv_heads, dim, block_size, dtype, g)
    starts = torch.zeros_like(ends) if window is None else (ends - window).clamp(min=0)
    q = torch.randn(len(ends), heads, dim, generator=g).to(dtype)
    got = gpu_attention.paged_decode(q, kv.layer(0), tables, starts, ends, 0.2, softcap, num_splits=splits)
    assert got.dtype == dtype and got.shape == q.shape
    want = _decode_reference(kv, q, tables, starts, ends, 0.2, softcap)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_decode_partitions_past_a_rows_end_contribute_nothing():
    """Eight partitions of a 300-token table: the short rows' later partitions are empty (no NaN), an
    empty context (start == end) gives zeros, and a too-small max_ctx still covers every key."""
    g = torch.Generator().manual_seed(1)
    ends = torch.tensor([1, 300, 17, 5])
    kv, tables = _cache(ends.tolist(), 2, 64, 16, torch.float32, g)
    starts = torch.tensor([0, 0, 3, 5])  # row 3 sees nothing
    q = torch.randn(4, 4, 64, generator=g)
    got = gpu_attention.paged_decode(q, kv.layer(0), tables, starts, ends, 0.125, num_splits=8)
    assert torch.isfinite(got).all()
    assert (got[3] == 0).all()
    want = _decode_reference(kv, q[:3], tables[:3], starts[:3], ends[:3], 0.125, None)
    torch.testing.assert_close(got[:3], want, atol=1e-4, rtol=1e-4)
    small = gpu_attention.paged_decode(q[:3], kv.layer(0), tables[:3], starts[:3], ends[:3], 0.125, max_ctx=32)
    torch.testing.assert_close(small, want, atol=1e-4, rtol=1e-4)


def _prefill_case(q_lens, ctx_lens, heads, kv_heads, dim, block_size, dtype, seed):
    """Packed q ``[T, H, D]`` of the sequences in a shuffled order (q_starts not sorted by sequence)."""
    g = torch.Generator().manual_seed(seed)
    kv, tables = _cache(ctx_lens, kv_heads, dim, block_size, dtype, g)
    order = torch.randperm(len(q_lens), generator=g).tolist()
    q_starts, row = [0] * len(q_lens), 0
    for s in order:
        q_starts[s], row = row, row + q_lens[s]
    q = torch.randn(row, heads, dim, generator=g).to(dtype)
    return kv, tables, q, q_starts


def _prefill_reference(kv, q, tables, q_starts, q_lens, ctx_lens, scale, softcap, window):
    out = torch.zeros(q.shape)
    for s, (start, n, c) in enumerate(zip(q_starts, q_lens, ctx_lens)):
        k, v = _context(kv, tables[s], c)
        qpos = torch.arange(c - n, c)
        first = (qpos - window + 1).clamp(min=0) if window is not None else torch.zeros_like(qpos)
        out[start : start + n] = _reference(q[start : start + n], k, v, qpos, first, scale, softcap)
    return out


PREFILL_CASES = [  # heads, kv_heads, dim, block_size, window, softcap
    (2, 2, 64, 16, None, None),
    (4, 2, 80, 16, 24, None),
    (8, 1, 64, 64, None, 20.0),
    (8, 2, 80, 64, 40, 5.0),
]
# per block size, (q_lens, ctx_lens): a whole prompt of several tiles (32 rows each on the interpreter), one
# new token after a cached prefix, new tokens after a prefix, a chunk after earlier chunks
PREFILL_LENS = {16: ([70, 1, 20, 30], [70, 50, 60, 90]), 64: ([70, 1, 33, 130], [70, 50, 100, 170])}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim,block_size,window,softcap", PREFILL_CASES)
def test_prefill_matches_torch_over_the_gathered_context(heads, kv_heads, dim, block_size, window, softcap, dtype):
    q_lens, ctx_lens = PREFILL_LENS[block_size]
    kv, tables, q, q_starts = _prefill_case(q_lens, ctx_lens, heads, kv_heads, dim, block_size, dtype, heads + dim)
    got = gpu_attention.paged_prefill(q, kv.layer(0), tables, q_starts, q_lens, ctx_lens, 0.2, softcap, window)
    assert got.dtype == dtype and got.shape == q.shape
    want = _prefill_reference(kv, q, tables, q_starts, q_lens, ctx_lens, 0.2, softcap, window)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_prefill_takes_cpu_tensors_and_a_prompt_longer_than_the_window():
    q_lens, ctx_lens = [300, 1], [300, 300]
    kv, tables, q, q_starts = _prefill_case(q_lens, ctx_lens, 2, 1, 64, 16, torch.float32, 7)
    got = gpu_attention.paged_prefill(q, kv.layer(0), tables, torch.tensor(q_starts), torch.tensor(q_lens),
                                      torch.tensor(ctx_lens), 0.125, window=50)
    want = _prefill_reference(kv, q, tables, q_starts, q_lens, ctx_lens, 0.125, None, 50)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_unsupported_shapes_are_refused_by_name():
    assert gpu_attention.supports(16, 80) and gpu_attention.supports(64, 256)
    assert not gpu_attention.supports(8, 64) and not gpu_attention.supports(24, 64)
    assert not gpu_attention.supports(16, 512)
    kv = KVCache(1, 4, 8, 1, 64)
    q, tables, ends = torch.randn(1, 2, 64), torch.zeros(1, 2, dtype=torch.int64), torch.tensor([5])
    with pytest.raises(ValueError, match="block_size 8"):
        gpu_attention.paged_decode(q, kv.layer(0), tables, torch.zeros_like(ends), ends, 0.125)
    with pytest.raises(ValueError, match="block_size 8"):
        gpu_attention.paged_prefill(q, kv.layer(0), tables, [0], [1], [5], 0.125)


def test_the_interpreter_is_chosen_without_touching_the_environment():
    before = os.environ.get("TRITON_INTERPRET")
    g = torch.Generator().manual_seed(3)
    kv, tables = _cache([20], 1, 16, 16, torch.float32, g)
    q = torch.randn(1, 1, 16, generator=g)
    ends = torch.tensor([20])
    got = gpu_attention.paged_decode(q, kv.layer(0), tables, torch.zeros_like(ends), ends, 0.25)
    torch.testing.assert_close(got, _decode_reference(kv, q, tables, torch.zeros_like(ends), ends, 0.25, None),
                               atol=1e-5, rtol=1e-5)
    assert os.environ.get("TRITON_INTERPRET") == before


def test_without_triton_the_module_says_why(monkeypatch):
    """The CPU image has no triton: available() is False and the kernels raise RuntimeError naming it."""
    monkeypatch.setattr(triton_jit, "_state", {})
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    assert not gpu_attention.available()
    kv = KVCache(1, 2, 16, 1, 16)
    with pytest.raises(RuntimeError, match="triton"):
        gpu_attention.paged_prefill(torch.randn(1, 1, 16), kv.layer(0), torch.zeros(1, 1, dtype=torch.int64),
                                    [0], [1], [1], 0.25)
