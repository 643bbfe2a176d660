"""engine/csrc/fp8_linear.cpp: FP8 weights read in place give the widened weights' result, on every code path.

Each ISA level's build (AVX-512, AVX2 + F16C, plain loops; ``native.build_library_variant``) widens all 256
e4m3 byte values exactly, dequantizes exactly (float32) or rounded once (bfloat16), and its ``fp8_linear``
equals ``x @ (w * scale).T + bias`` up to the order of the sums, for shapes with tails (K not a multiple of
16, N not of 4, 1 to 7 rows) in float32 and bfloat16. Bad arguments are refused naming them; ``fp8.cpu_linear``
on the CPU gives the same at few rows (the kernel) and many (widened into a buffer).
"""


import pytest
import torch

from harness.isa_levels import ISA_LEVELS, namespace, needs_compiler
from pdserve.engine import fp8, native



def _ops(level):
    if level == "native":
        ops = native.fp8_ops()
        assert ops is not None, native.fp8_unavailable_reason()
        return ops
    return native.build_library_variant(namespace("pdserve_fp8", level), native.FP8_SOURCE, march=level)


def _weights(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)  # rows of different ranges
    w[0, :3] = torch.tensor([1e-6, -3e-5, 0.0])  # values that become FP8 subnormals or zero
    return fp8.quantize(w)


@needs_compiler
@pytest.mark.parametrize("level", ISA_LEVELS)
def test_every_byte_widens_exactly(level):
    ops = _ops(level)
    every = torch.arange(256, dtype=torch.uint8).view(16, 16).contiguous()
    ref = every.view(fp8.FP8).float() * 3.0
    out = ops.fp8_dequantize(every, torch.full((16,), 3.0), torch.empty(16, 16))
    finite = ~torch.isnan(ref)  # 0x7F and 0xFF: e4m3fn's NaN (never produced by quantize)
    assert torch.equal(out[finite], ref[finite])
    bf = ops.fp8_dequantize(every, torch.full((16,), 3.0), torch.empty(16, 16, dtype=torch.bfloat16))
    assert torch.equal(bf[finite], ref[finite].to(torch.bfloat16))


@needs_compiler
@pytest.mark.parametrize("level", ISA_LEVELS)
@pytest.mark.parametrize("n,k", [(37, 100), (64, 256), (5, 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_equals_the_widened_weights(level, n, k, dtype):
    ops = _ops(level)
    w8, scale = _weights(n, k)
    wide = fp8.dequantize(w8, scale, torch.float32)
    assert torch.equal(ops.fp8_dequantize(w8.view(torch.uint8), scale, torch.empty(n, k)), wide)
    bias = torch.randn(n)
    for m in range(1, 8):
        x = torch.randn(m, k).to(dtype)
        out = ops.fp8_linear(x, w8.view(torch.uint8), scale, bias if m % 2 else None)
        ref = x.float() @ wide.t() + (bias if m % 2 else 0)
        assert out.dtype == dtype and out.shape == (m, n)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert (out.float() - ref).abs().max().item() <= tol * ref.abs().max().item()


@needs_compiler
def test_bad_arguments_are_named():
    ops = _ops("native")
    w8, scale = _weights(8, 32)
    with pytest.raises(RuntimeError, match="x must be \\[M, K\\] with K = 32"):
        ops.fp8_linear(torch.randn(2, 31), w8.view(torch.uint8), scale, None)
    with pytest.raises(RuntimeError, match="scale must be float32 \\[N\\]"):
        ops.fp8_linear(torch.randn(2, 32), w8.view(torch.uint8), scale[:4], None)
    with pytest.raises(RuntimeError, match="uint8 view of float8_e4m3fn"):
        ops.fp8_linear(torch.randn(2, 32), w8.view(torch.uint8).t(), scale, None)


@pytest.mark.parametrize("rows", [1, fp8.FEW_ROWS, fp8.FEW_ROWS + 1, 40])
def test_cpu_linear_at_few_and_many_rows(rows):
    w8, scale = _weights(48, 64, seed=2)
    x = torch.randn(2, rows, 64)  # leading dims kept
    out = fp8.cpu_linear(x, w8, scale, None)
    ref = x @ fp8.dequantize(w8, scale, torch.float32).t()
    assert out.shape == (2, rows, 48)
    assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_checkpoint_scales_are_per_tensor_or_per_row():
    assert torch.equal(fp8.row_scales(torch.tensor(2.0), 3, "s"), torch.full((3,), 2.0))
    assert torch.equal(fp8.row_scales(torch.tensor([[1.0], [2.0]]), 2, "s"), torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"w.weight_scale has shape \(2, 4\): expected one value \(per-tensor\) "
                                         r"or one per output row \(2, per-channel\)"):
        fp8.row_scales(torch.ones(2, 4), 2, "w.weight_scale")
