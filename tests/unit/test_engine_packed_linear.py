"""engine/packed_linear.py: the packed (oneDNN) path gives F.linear's results at every batch size."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine import mkl_gemm, packed_linear
from pdserve.engine.loader import load_model
from pdserve.engine.packed_linear import PLAIN_MAX_ROWS, linear, pack_linears

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear_at_every_row_count(dtype, tol, bias, monkeypatch):
    monkeypatch.setattr(packed_linear, "PACK_MIN_ELEMENTS", 0)
    torch.manual_seed(0)
    m = nn.Linear(96, 200, bias=bias).to(dtype)
    assert pack_linears(m) == 1 and m.packed_weight is not None
    for rows in (1, PLAIN_MAX_ROWS, PLAIN_MAX_ROWS + 1, 8, 17, 300):
        x = torch.randn(rows, 96, dtype=dtype)
        got, want = linear(x, m), F.linear(x, m.weight, m.bias)
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_unpacked_module_and_other_dtypes_use_f_linear():
    m = nn.Linear(8, 4).to(torch.float16)
    assert pack_linears(m) == 0 and not hasattr(m, "packed_weight")
    x = torch.randn(6, 8, dtype=torch.float16)
    assert torch.equal(linear(x, m), F.linear(x, m.weight, m.bias))


@needs_onednn
def test_loaded_model_packs_its_linears_and_gives_the_plain_logits(monkeypatch):
    """Every nn.Linear of a loaded CPU model is packed; 6 rows through it give F.linear's logits."""
    monkeypatch.setattr(packed_linear, "PACK_MIN_ELEMENTS", 0)  # the tiny model's weights are all small
    model = load_model("tiny").model
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(hasattr(m, "packed_weight") for m in linears)
    ids = torch.arange(6) + 3
    packed = model.forward_dense(ids)
    monkeypatch.setattr(packed_linear, "PLAIN_MAX_ROWS", 10**9)
    plain = model.forward_dense(ids)
    torch.testing.assert_close(packed, plain, atol=1e-4, rtol=1e-4)
    assert packed.argmax(-1).tolist() == plain.argmax(-1).tolist()


@needs_onednn
def test_small_weights_stay_on_f_linear():
    small, large = nn.Linear(1024, 128), nn.Linear(1024, 1024)  # 128K and 1M weights
    assert pack_linears(nn.Sequential(small, large)) == 1
    assert not hasattr(small, "packed_weight") and hasattr(large, "packed_weight")


@needs_onednn
def test_engine_switch_drops_and_restores_the_packed_copies(monkeypatch):
    """EngineConfig.packed_linear off: F.linear everywhere (the packed copies' memory back); on again: packed."""
    from pdserve.engine import EngineConfig, LLMEngine, load_model
    from pdserve.engine.packed_linear import unpack_linears

    monkeypatch.setattr(packed_linear, "PACK_MIN_ELEMENTS", 0)  # the tiny model's linears are all small
    loaded = load_model("tiny")
    layers = [m for m in loaded.model.modules() if isinstance(m, nn.Linear)]
    m = nn.Linear(1024, 1024)
    assert pack_linears(m) == 1 and pack_linears(m) == 0  # packed once
    unpack_linears(m)
    assert not hasattr(m, "packed_weight") and pack_linears(m) == 1
    LLMEngine(loaded, EngineConfig(num_blocks=8, packed_linear=False))
    assert not any(hasattr(x, "packed_weight") for x in layers)
    LLMEngine(loaded, EngineConfig(num_blocks=8))
    assert all(getattr(x, "packed_weight", None) is not None for x in layers)


@needs_onednn
def test_a_module_cast_after_packing_falls_back_to_f_linear():
    m = nn.Linear(1024, 1024)
    assert pack_linears(m) == 1
    m.to(torch.bfloat16)  # the packed copy is still float32: it must not be used
    x = torch.randn(8, 1024, dtype=torch.bfloat16)
    assert torch.equal(linear(x, m), F.linear(x, m.weight, m.bias))


def _onednn_packs_bf16() -> bool:
    """Whether oneDNN reorders a bf16 weight on this CPU at all (it needs AVX-512 or AVX-NE-CONVERT;
    an AVX2-only CPU, e.g. AMD Zen 3, has neither, and the engine widens bf16 to fp32 there)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 8)
        return True
    except (RuntimeError, AttributeError):
        return False


@needs_onednn
@pytest.mark.parametrize("native", [True, False])
def test_bf16_is_widened_to_fp32_only_where_the_cpu_emulates_it(native, monkeypatch):
    """Without bf16 instructions the packed copy is fp32 (bias too); results stay bf16 and match. Where
    oneDNN cannot pack bf16 at all, the copy is widened even when the CPU is said to have them."""
    widened = not (native and _onednn_packs_bf16())
    monkeypatch.setattr(packed_linear, "PACK_MIN_ELEMENTS", 0)
    monkeypatch.setattr(packed_linear, "native_bf16", lambda: native)
    torch.manual_seed(1)
    m = nn.Linear(96, 200, bias=True).to(torch.bfloat16)
    assert pack_linears(m) == 1
    assert m.packed_weight.dtype == (torch.float32 if widened else torch.bfloat16)
    assert m.packed_bias.dtype == m.packed_weight.dtype and m.packed_from == torch.bfloat16
    for rows in (1, 2, 4, 17, 300):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        got = linear(x, m)
        exact = F.linear(x.float(), m.weight.float(), m.bias.float())  # what bf16 hardware accumulates
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 200)
        # one bf16 rounding of the fp32 sum (relative 2^-8), whichever way it was computed
        torch.testing.assert_close(got.float(), exact, atol=1e-2, rtol=8e-3)


needs_mkl = pytest.mark.skipif(not mkl_gemm.available(), reason="MKL's packed sgemm is not reachable in this torch")


@needs_mkl
@pytest.mark.parametrize("bias", [False, True])
def test_float32_weights_are_packed_by_mkl_and_give_f_linear_at_every_row_count(bias, monkeypatch):
    """One MKL-packed copy serves every row count (a decode step's few rows and a prefill's hundreds)."""
    monkeypatch.setattr(packed_linear, "PACK_MIN_ELEMENTS", 0)
    torch.manual_seed(0)
    m = nn.Linear(300, 130, bias=bias)
    assert pack_linears(m) == 1 and isinstance(m.packed_weight, mkl_gemm.PackedWeight)
    for rows in (1, PLAIN_MAX_ROWS + 1, 8, 33, 512):
        x = torch.randn(rows, 300)
        torch.testing.assert_close(linear(x, m), F.linear(x, m.weight, m.bias), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(linear(x.t().contiguous().t(), m), F.linear(x, m.weight, m.bias))  # strided rows


@needs_mkl
def test_mkl_pack_refuses_what_it_cannot_multiply():
    with pytest.raises(ValueError, match="float32 2-D"):
        mkl_gemm.pack(torch.zeros(4, 4, dtype=torch.bfloat16))
    packed = mkl_gemm.pack(torch.zeros(4, 6))
    with pytest.raises(ValueError, match=r"float32 \[rows, 6\]"):
        mkl_gemm.linear(torch.zeros(2, 5), packed, None)
    assert mkl_gemm.linear(torch.zeros(0, 6), packed, None).shape == (0, 4)
