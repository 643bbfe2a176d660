"""engine/gpu_elementwise.py: the Triton RMSNorm and rotary kernels give what the torch forms of
engine/layer_ops.py give (TorchOps: a RMSNorm module's forward, rope), run here on CPU tensors under Triton's
interpreter (the module decorates them for it on its own).

float32: rotary bitwise equal, RMSNorm within float32 rounding (only the order of the sum of squares
differs). bfloat16: within one bf16 rounding step, because Triton's interpreter truncates float32
to bf16 where the GPU (and torch) round to nearest; the GPU check compares them bitwise on CUDA
(tools/gpu/probes.py fused_exactness). Which models run them (CUDA, EngineConfig.fused_elementwise):
tests/unit/test_layer_ops.py."""

import pytest
import torch

from pdserve.engine import gpu_elementwise
from pdserve.engine.layer_ops import TorchOps
from pdserve.engine.models.llama import RMSNorm

apply_rope = TorchOps.rope  # the torch form the kernel replaces

BF16_STEP = 2**-7  # one bf16 rounding step, relative


def _norm(n: int, dtype, g):
    norm = RMSNorm(n, 1e-6).to(dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    return norm


@pytest.mark.parametrize("shape", [(5, 256), (3, 4096), (2, 3, 80), (1, 7)])
def test_rms_norm_matches_the_torch_form_in_float32(shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 3
    norm = _norm(shape[-1], torch.float32, g)
    got = gpu_elementwise.rms_norm(x, norm.weight, norm.eps)
    assert got.shape == x.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, norm(x), atol=2e-6, rtol=2e-6)


def test_rms_norm_in_bfloat16_is_within_one_rounding_step():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 512, generator=g) * 2).to(torch.bfloat16)
    norm = _norm(512, torch.bfloat16, g)
    got, want = gpu_elementwise.rms_norm(x, norm.weight, norm.eps), norm(x)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want.float()).abs() <= 2 * BF16_STEP * want.float().abs() + 1e-6).all()


@pytest.mark.parametrize("tokens,heads,dim", [(3, 4, 64), (5, 32, 128), (2, 3, 80)])
def test_rope_is_bitwise_the_torch_form_in_float32(tokens, heads, dim):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, heads, dim, generator=g)
    angle = torch.randn(tokens, 1, dim, generator=g) * 20
    assert torch.equal(gpu_elementwise.rope(x, angle.cos(), angle.sin()), apply_rope(x, angle.cos(), angle.sin()))


def test_rope_in_bfloat16_is_within_one_rounding_step_per_op():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 8, 64, generator=g).to(torch.bfloat16)
    angle = torch.randn(4, 1, 64, generator=g) * 20
    cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
    got, want = gpu_elementwise.rope(x, cos, sin), apply_rope(x, cos, sin)
    rotated = torch.cat((-x[..., 32:], x[..., :32]), dim=-1).float()
    bound = 3 * BF16_STEP * ((x.float() * cos.float()).abs() + (rotated * sin.float()).abs())
    assert ((got.float() - want.float()).abs() <= bound + 1e-6).all()


def test_bad_shapes_are_refused_with_the_reason():
    x = torch.randn(2, 4, 64)
    with pytest.raises(ValueError, match="weight"):
        gpu_elementwise.rms_norm(x, torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="cos must be"):
        gpu_elementwise.rope(x, torch.ones(2, 1, 32), torch.ones(2, 1, 64))
    with pytest.raises(ValueError, match="even head_dim"):
        gpu_elementwise.rope(torch.randn(2, 4, 63), torch.ones(2, 1, 63), torch.ones(2, 1, 63))


def test_empty_inputs_give_empty_outputs():
    assert gpu_elementwise.rms_norm(torch.randn(0, 16), torch.ones(16), 1e-6).shape == (0, 16)
    assert gpu_elementwise.rope(torch.randn(0, 2, 8), torch.ones(0, 1, 8), torch.ones(0, 1, 8)).shape == (0, 2, 8)


@pytest.mark.parametrize("tokens,inter", [(1, 40), (3, 1500), (2, 2048)])
def test_silu_mul_matches_the_torch_form(tokens, inter):
    g = torch.Generator().manual_seed(4)
    gate_up = torch.randn(tokens, 2 * inter, generator=g) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(gpu_elementwise.silu_mul(gate_up), want, atol=1e-6, rtol=1e-6)
    bf = gate_up.to(torch.bfloat16)
    got_bf = gpu_elementwise.silu_mul(bf)
    gate, up = bf.chunk(2, dim=-1)
    want_bf = torch.nn.functional.silu(gate) * up
    assert got_bf.dtype == torch.bfloat16
    assert ((got_bf.float() - want_bf.float()).abs() <= 3 * BF16_STEP * want_bf.float().abs() + 1e-6).all()
    with pytest.raises(ValueError, match="gate_up"):
        gpu_elementwise.silu_mul(torch.randn(2, 5))
