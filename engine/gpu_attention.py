"""Triton kernels for the engine's attention on CUDA, reading the paged KV cache in place (no gather).

Both kernels take one layer's cache ``kv_layer`` ``[num_blocks, 2 (K, V), block_size, num_kv_heads,
head_dim]`` (``KVCache.layer(i)``, any strides but a unit last one) and the block tables, and find
token t of a sequence in block ``table[t // block_size]`` at offset ``t % block_size``. Query head h
reads KV head ``h // (H // KVH)`` (GQA). Scores are ``scale * q.k``, optionally soft-capped
(``softcap * tanh(scores / softcap)``, Gemma 2), and a sliding window lets a query at position p see
keys ``p - window < j <= p``. Softmax runs online in float32; fp32 inputs take IEEE dots (no TF32),
bf16/fp16 inputs dot in their dtype with fp32 accumulation; cache loads are cast to q's dtype.

* ``paged_decode``: one new token per sequence (flash-decoding). Grid (B, KVH, num_splits): a
  program takes ONE KV head with ALL its query heads as the rows of one tile (the GQA group,
  padded to a power of two >= 16 so ``tl.dot`` lowers to tensor cores), so each K/V block is read
  once per KV head, and walks one partition of the sequence's blocks (one cache block per
  iteration). It writes partial (max, sum, unnormalized output) per partition; a second small
  kernel, grid (B, H), merges them. The partition count is chosen on the host from ``max_ctx``
  (by default the tables' width, so no device->host read: the launch can be CUDA-graph captured)
  and B * KVH, aiming at ~256 programs so a small batch still fills the GPU. The last partition
  runs to the row's end, so ``max_ctx`` only tunes the split, never the result; partitions past a
  row's end contribute (max -inf, sum 0).
* ``paged_prefill``: the new tokens of S packed prompts at once (varlen, no padding). A tile is
  BLOCK_M consecutive new rows of one sequence (the tile map is built on the host from the
  prompt lengths, longest work first); grid (tiles, H), one query head per program: prefill is
  compute-bound, so re-reading a K/V block per query head of a group is mostly L2 traffic, and
  per-head programs keep the tile small and give short prompts more programs. Keys are walked
  block by block from the window's start up to the tile's last position (causal); rows sit at
  ``ctx_len - q_len + i``, so a prefix-cache hit or an earlier chunk is just more context.

Why Triton: portable Python kernels compiled just in time for the GPU at hand (no nvcc, no
prebuilt binaries per architecture at run time), and the same kernel bodies run on CPU tensors
under Triton's interpreter, which is how the tests check them on a machine without a GPU
(``triton_jit.py`` decorates the bodies once per mode). Each kernel is self-contained (no calls
to other jit functions) for that reason. The interpreter's ``tl.dot`` cannot
multiply bfloat16 (triton-lang/triton#11584), so there the dots take float32 operands rounded to q's
dtype: the same products and fp32 sums as the GPU's bf16 MMA.

Triton is imported lazily: where it is missing (the CPU image), this module still imports,
``available()`` is False and the kernels raise RuntimeError. ``supports`` says which cache shapes
they take (block_size a power of two >= 16, head_dim <= 256, any head_dim padded with masks);
elsewhere they raise ValueError and the caller keeps its torch path. Compiled offline for sm_90 and
sm_80, a program needs at most ~50 KB of shared memory in bf16/fp16, but float32 with head_dim 256
and block_size 64 needs ~170 KB (more than an A100 has).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import torch

from . import triton_jit

_TARGET_PROGRAMS = 256  # decode: programs (B * KVH * splits) that fill a GPU's SMs a few times over
_MAX_HEAD_DIM = 256  # a [rows, 256] fp32 accumulator per program is the most that stays in registers


# ---------------------------------------------------------------------------------------------
# Kernel bodies: plain functions, decorated per mode by triton_jit.kernels() (which binds ``tl``;
# no tl.max / tl.sum / tl.zeros: reductions are ``tl.reduce`` with tl.standard's combine functions).


def _decode_partials(Q, KV, TABLES, STARTS, ENDS, M_OUT, L_OUT, ACC_OUT, scale, softcap, blocks_per_split,
                     num_heads, stride_qb, stride_qh, stride_kvn, stride_kvkv, stride_kvt, stride_kvh,
                     stride_tb, stride_tn, HEAD_DIM: tl.constexpr, DIM_P: tl.constexpr, GROUP: tl.constexpr,
                     GROUP_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, SOFTCAP: tl.constexpr,
                     DOT_TY: tl.constexpr):
    # One (sequence b, KV head, partition): the GROUP query heads of the KV head are the rows.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    rows = tl.arange(0, GROUP_P)
    dims = tl.arange(0, DIM_P)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kvh * GROUP + rows
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q_dot = q.to(DOT_TY)
    start = tl.load(STARTS + b)
    end = tl.load(ENDS + b)
    n_blocks = (end + BLOCK_SIZE - 1) // BLOCK_SIZE
    lo = split * blocks_per_split
    hi = tl.where(split == num_splits - 1, n_blocks, tl.minimum(lo + blocks_per_split, n_blocks))
    lo = tl.maximum(lo, start // BLOCK_SIZE)
    offs = tl.arange(0, BLOCK_SIZE)
    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.full([GROUP_P], 0.0, tl.float32)
    acc = tl.full([GROUP_P, DIM_P], 0.0, tl.float32)
    for blk in range(lo, hi):
        block_id = tl.load(TABLES + b * stride_tb + blk * stride_tn).to(tl.int64)
        base = KV + block_id * stride_kvn + kvh * stride_kvh
        keys = blk * BLOCK_SIZE + offs
        valid = (keys >= start) & (keys < end)
        k_t = tl.load(base + offs[None, :] * stride_kvt + dims[:, None], mask=dim_ok[:, None], other=0.0)
        v = tl.load(base + stride_kvkv + offs[:, None] * stride_kvt + dims[None, :],  # no garbage (NaN) past the end
                    mask=valid[:, None] & dim_ok[None, :], other=0.0)
        s = tl.dot(q_dot, k_t.to(q.dtype).to(DOT_TY), input_precision="ieee") * scale  # [GROUP_P, BLOCK_SIZE]
        if SOFTCAP:  # softcap * tanh(s / softcap), tanh from exp(-2|x|): no overflow for any x
            x = s / softcap
            t = tl.exp(-2.0 * tl.abs(x))
            th = (1.0 - t) / (1.0 + t)
            s = softcap * tl.where(x < 0, -th, th)
        s = tl.where(valid[None, :], s * 1.4426950408889634, float("-inf"))  # log2(e): exp2 below
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: no -inf - -inf
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype).to(DOT_TY), v.to(q.dtype).to(DOT_TY),
                                                 input_precision="ieee")
        m_i = m_new
    idx = (b * num_heads + heads) * num_splits + split
    tl.store(M_OUT + idx, m_i, mask=row_ok)
    tl.store(L_OUT + idx, l_i, mask=row_ok)
    tl.store(ACC_OUT + idx[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])


def _decode_combine(M_IN, L_IN, ACC_IN, OUT, num_splits, stride_ob, stride_oh, HEAD_DIM: tl.constexpr,
                    DIM_P: tl.constexpr, SPLITS_P: tl.constexpr):
    # One (sequence, query head): the partitions' partial softmaxes rescaled to the common max.
    b = tl.program_id(0)
    h = tl.program_id(1)
    num_heads = tl.num_programs(1)
    parts = tl.arange(0, SPLITS_P)
    dims = tl.arange(0, DIM_P)
    part_ok = parts < num_splits
    dim_ok = dims < HEAD_DIM
    idx = (b * num_heads + h) * num_splits + parts
    m = tl.load(M_IN + idx, mask=part_ok, other=float("-inf"))
    sums = tl.load(L_IN + idx, mask=part_ok, other=0.0)
    acc = tl.load(ACC_IN + idx[:, None] * HEAD_DIM + dims[None, :], mask=part_ok[:, None] & dim_ok[None, :],
                  other=0.0)
    m_max = tl.reduce(m, 0, tl.standard._elementwise_max)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # an empty partition: exp2(-inf) = 0
    denom = tl.reduce(w * sums, 0, tl.standard._sum_combine)
    denom = tl.where(denom > 0, denom, 1.0)  # an empty context gives 0, not NaN
    out = tl.reduce(acc * w[:, None], 0, tl.standard._sum_combine) / denom
    tl.store(OUT + b * stride_ob + h * stride_oh + dims, out.to(OUT.dtype.element_ty), mask=dim_ok)


def _prefill(Q, KV, TABLES, TILES, OUT, scale, softcap, window, stride_qt, stride_qh, stride_ot, stride_oh,
             stride_kvn, stride_kvkv, stride_kvt, stride_kvh, stride_tb, stride_tn, GROUP: tl.constexpr,
             HEAD_DIM: tl.constexpr, DIM_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr,
             SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, DOT_TY: tl.constexpr):
    # One (tile of BLOCK_M new rows of one sequence, query head). TILES rows: (sequence, first q row,
    # rows left in the sequence from there, position of the first row).
    tile = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    seq = tl.load(TILES + tile * 4)
    q_row0 = tl.load(TILES + tile * 4 + 1)
    n_rows = tl.minimum(tl.load(TILES + tile * 4 + 2), BLOCK_M)
    pos0 = tl.load(TILES + tile * 4 + 3)
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, DIM_P)
    row_ok = rows < n_rows
    dim_ok = dims < HEAD_DIM
    qpos = pos0 + rows
    q = tl.load(Q + (q_row0 + rows)[:, None] * stride_qt + h * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q_dot = q.to(DOT_TY)
    last = pos0 + n_rows - 1  # the tile's last position: no key after it is seen (causal)
    first = 0
    if WINDOW:
        first = tl.maximum(pos0 - window + 1, 0)
    offs = tl.arange(0, BLOCK_SIZE)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, DIM_P], 0.0, tl.float32)
    for blk in range(first // BLOCK_SIZE, last // BLOCK_SIZE + 1):
        block_id = tl.load(TABLES + seq * stride_tb + blk * stride_tn).to(tl.int64)
        base = KV + block_id * stride_kvn + kvh * stride_kvh
        keys = blk * BLOCK_SIZE + offs
        k_t = tl.load(base + offs[None, :] * stride_kvt + dims[:, None], mask=dim_ok[:, None], other=0.0)
        v = tl.load(base + stride_kvkv + offs[:, None] * stride_kvt + dims[None, :],  # no garbage (NaN) past the end
                    mask=(keys <= last)[:, None] & dim_ok[None, :], other=0.0)
        s = tl.dot(q_dot, k_t.to(q.dtype).to(DOT_TY), input_precision="ieee") * scale  # [BLOCK_M, BLOCK_SIZE]
        if SOFTCAP:  # softcap * tanh(s / softcap), tanh from exp(-2|x|): no overflow for any x
            x = s / softcap
            t = tl.exp(-2.0 * tl.abs(x))
            th = (1.0 - t) / (1.0 + t)
            s = softcap * tl.where(x < 0, -th, th)
        seen = keys[None, :] <= qpos[:, None]
        if WINDOW:
            seen = seen & (keys[None, :] > qpos[:, None] - window)
        s = tl.where(seen, s * 1.4426950408889634, float("-inf"))  # log2(e): exp2 below
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: no -inf - -inf
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype).to(DOT_TY), v.to(q.dtype).to(DOT_TY),
                                                 input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(OUT + (q_row0 + rows)[:, None] * stride_ot + h * stride_oh + dims[None, :],
             out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


_BODIES = (_decode_partials, _decode_combine, _prefill)


# ---------------------------------------------------------------------------------------------
# Host side.


def available() -> bool:
    """Whether triton imports here (the kernels' only requirement besides a supported cache shape)."""
    return triton_jit.available()


def usable(kv) -> bool:
    """Whether the engine runs its attention on these kernels for this KVCache: a CUDA cache of a
    shape they take, and triton here. On CPU the engine keeps attention.py (and its C++ decode):
    the interpreter is for the tests. An fp8 cache (``kv_dtype="fp8"``) is not one of them: the kernels
    read 16/32-bit rows, so the engine runs attention.py (dequantizing on the gather) there, correct
    but slower (``ModelRunner`` logs it)."""
    return (kv.device.type == "cuda" and not getattr(kv, "fp8", False) and supports(kv.block_size, kv.head_dim)
            and available())


def supports(block_size: int, head_dim: int) -> bool:
    """Whether the kernels take a cache of this block size and head size."""
    return _shape_problem(block_size, head_dim) is None


def _shape_problem(block_size: int, head_dim: int) -> str | None:
    if block_size < 16 or block_size & (block_size - 1):
        return f"block_size {block_size} is not a power of two >= 16"
    if not 1 <= head_dim <= _MAX_HEAD_DIM:
        return f"head_dim {head_dim} is outside 1..{_MAX_HEAD_DIM}"
    return None


def _kernels(interpret: bool) -> SimpleNamespace:
    """The three kernels decorated for the interpreter (CPU tensors) or the compiler, once each."""
    return triton_jit.kernels(_BODIES, interpret)


def _dot_type(dtype: torch.dtype, interpret: bool):
    """The dtype the kernels' dots take: q's (fp32 accumulation), but float32 under the interpreter,
    whose ``tl.dot`` multiplies bfloat16 bit patterns as integers (triton-lang/triton#11584). The
    operands are rounded to q's dtype first, so the sums are what a bf16 MMA with fp32 accumulation gives."""
    tl = triton_jit.triton_modules()[1]
    types_ = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    if dtype not in types_:
        raise ValueError(f"the Triton attention kernels take float32, bfloat16 or float16 q, not {dtype}")
    return tl.float32 if interpret else types_[dtype]


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << (n - 1).bit_length())


def _check(q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor) -> tuple[int, int, int]:
    """(block_size, num_kv_heads, head_dim) of a cache layer the kernels take with this q; else ValueError."""
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 2:
        raise ValueError(f"kv_layer must be [num_blocks, 2, block_size, kv_heads, head_dim], "
                         f"got {tuple(kv_layer.shape)}")
    _, _, block_size, kv_heads, head_dim = kv_layer.shape
    problem = _shape_problem(block_size, head_dim)
    if problem is not None:
        raise ValueError(f"the Triton attention kernels cannot take this cache: {problem}")
    if q.dim() != 3 or q.shape[-1] != head_dim or q.shape[1] % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of {kv_heads} KV heads of size {head_dim}")
    if kv_layer.stride(-1) != 1:
        raise ValueError("kv_layer's last dimension must be contiguous")
    if tables.dim() != 2:
        raise ValueError(f"tables must be [sequences, max_blocks], got {tuple(tables.shape)}")
    if not (q.device == kv_layer.device == tables.device):
        raise ValueError(f"q, kv_layer and tables must be on one device: {q.device}, {kv_layer.device}, "
                         f"{tables.device}")
    return block_size, kv_heads, head_dim


def paged_decode(q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor, starts: torch.Tensor,
                 ends: torch.Tensor, scale: float | None, softcap: float | None = None, max_ctx: int | None = None,
                 *, num_splits: int | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context: q ``[B, H, D]``, tables
    ``[B, max_blocks]`` (padded with any valid block id), row b attends to keys ``starts[b] <= j <
    ends[b]`` (``ends`` the context length, the new token's K/V already written at ``ends[b] - 1``;
    ``starts`` > 0 for a sliding window) -> ``[B, H, D]`` in q's dtype. ``max_ctx`` bounds the
    context lengths for choosing the partition count (default: the tables' width); ``num_splits``
    forces that count (tests). Same call as the CPU op (native.py) plus softcap; no host sync."""
    block_size, kv_heads, head_dim = _check(q, kv_layer, tables)
    interpret = q.device.type == "cpu"
    kernels, dot_ty = _kernels(interpret), _dot_type(q.dtype, interpret)
    batch, heads, _ = q.shape
    for name, t in (("tables", tables), ("starts", starts), ("ends", ends)):
        if t.shape[0] != batch or t.device != q.device:
            raise ValueError(f"{name} {tuple(t.shape)} on {t.device} does not fit q {tuple(q.shape)} on {q.device}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    ctx_blocks = -(-(max_ctx if max_ctx is not None else tables.shape[1] * block_size) // block_size)
    if num_splits is None:
        num_splits = min(-(-_TARGET_PROGRAMS // (batch * kv_heads)), ctx_blocks)
    num_splits = max(1, num_splits)
    blocks_per_split = max(1, -(-ctx_blocks // num_splits))
    part = torch.empty(2, batch, heads, num_splits, dtype=torch.float32, device=q.device)
    part_acc = torch.empty(batch, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    group = heads // kv_heads
    dim_p = _pow2(head_dim, 16)
    kernels.decode_partials[(batch, kv_heads, num_splits)](
        q, kv_layer, tables, starts, ends, part[0], part[1], part_acc, _scale(scale, head_dim),
        _softcap(softcap), blocks_per_split, heads, q.stride(0), q.stride(1), *kv_layer.stride()[:4],
        *tables.stride(), HEAD_DIM=head_dim, DIM_P=dim_p, GROUP=group, GROUP_P=_pow2(group, 16),
        BLOCK_SIZE=block_size, SOFTCAP=softcap is not None, DOT_TY=dot_ty, num_warps=4)
    kernels.decode_combine[(batch, heads)](
        part[0], part[1], part_acc, out, num_splits, out.stride(0), out.stride(1), HEAD_DIM=head_dim,
        DIM_P=dim_p, SPLITS_P=_pow2(num_splits, 2), num_warps=4 if dim_p >= 128 else 2)
    return out


def paged_prefill(q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor, q_starts: Sequence[int] | torch.Tensor,
                  q_lens: Sequence[int] | torch.Tensor, ctx_lens: Sequence[int] | torch.Tensor, scale: float | None,
                  softcap: float | None = None, window: int | None = None, *,
                  launch: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Causal attention of the packed new tokens of S sequences over their paged contexts, in one
    launch: q ``[T, H, D]``; sequence s owns rows ``[q_starts[s], q_starts[s] + q_lens[s])``, has
    ``ctx_lens[s]`` tokens of context in blocks ``tables[s]`` (its new tokens' K/V already written,
    at the last ``q_lens[s]`` positions), so its new row i sits at ``ctx_lens[s] - q_lens[s] + i``.
    ``window``: a query at p sees keys ``p - window < j <= p``. -> ``[T, H, D]`` in q's dtype (rows
    no sequence owns are left unwritten). The lengths are host values (lists, or CPU tensors).
    ``launch``: (BLOCK_M, num_warps, num_stages) instead of the defaults (the GPU check's tuning A/B)."""
    block_size, kv_heads, head_dim = _check(q, kv_layer, tables)
    interpret = q.device.type == "cpu"
    kernels, dot_ty = _kernels(interpret), _dot_type(q.dtype, interpret)
    starts, lens, ctx = _ints(q_starts), _ints(q_lens), _ints(ctx_lens)
    if not len(starts) == len(lens) == len(ctx) <= tables.shape[0]:
        raise ValueError(f"q_starts, q_lens, ctx_lens ({len(starts)}, {len(lens)}, {len(ctx)}) and tables "
                         f"({tables.shape[0]} rows) disagree on the number of sequences")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dim_p = _pow2(head_dim, 16)
    # 32 rows under the interpreter: its dots are numpy matmuls, and larger ones go multi-threaded in
    # OpenBLAS, which stalls (5x slower) on a busy CPU
    block_m, warps, stages = launch or (32 if interpret or dim_p > 128 else 64, 4, None)
    tiles = _tiles(starts, lens, ctx, q.shape[0], tables.shape[1] * block_size, block_m)
    if not tiles:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    tile_map = torch.tensor(tiles, dtype=torch.int64).to(q.device, non_blocking=True)
    heads = q.shape[1]
    kernels.prefill[(len(tiles), heads)](
        q, kv_layer, tables, tile_map, out, _scale(scale, head_dim), _softcap(softcap), int(window or 1),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *kv_layer.stride()[:4], *tables.stride(),
        GROUP=heads // kv_heads, HEAD_DIM=head_dim, DIM_P=dim_p, BLOCK_M=block_m, BLOCK_SIZE=block_size,
        SOFTCAP=softcap is not None, WINDOW=window is not None, DOT_TY=dot_ty, num_warps=warps,
        **({} if stages is None else {"num_stages": stages}))
    return out


def _scale(scale: float | None, head_dim: int) -> float:
    return head_dim**-0.5 if scale is None else float(scale)


def _softcap(softcap: float | None) -> float:
    """The kernels' softcap argument (ignored where None: SOFTCAP is off)."""
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 (or None: off), got {softcap}")
    return 1.0 if softcap is None else float(softcap)


def _ints(values: Sequence[int] | torch.Tensor) -> list[int]:
    return values.tolist() if isinstance(values, torch.Tensor) else [int(v) for v in values]


def _tiles(starts: list[int], lens: list[int], ctx: list[int], num_rows: int, max_ctx: int,
           block_m: int) -> list[tuple[int, int, int, int]]:
    """The prefill tile map: (sequence, first q row, rows left from there, first row's position) per
    BLOCK_M rows of each sequence, the tiles with the most keys to read first (the GPU's tail stays short)."""
    tiles = []
    for s, (start, n, c) in enumerate(zip(starts, lens, ctx)):
        if n < 0 or c < n or c > max_ctx or start < 0 or start + n > num_rows:
            raise ValueError(f"sequence {s}: q rows [{start}, {start + n}) of {num_rows}, context {c} "
                             f"(at most {max_ctx} by its table) do not fit")
        tiles += [(s, start + r, n - r, c - n + r) for r in range(0, n, block_m)]
    tiles.sort(key=lambda t: -(t[3] + min(t[2], block_m)))
    return tiles
