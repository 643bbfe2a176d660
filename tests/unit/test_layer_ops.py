"""engine/layer_ops.py: the ops a model's layers run, chosen once by device and switches, without a GPU.

Which ops each device and switch gets (CPU: packed linears and the C++ FP8 kernel; CUDA: Triton's fused
kernels where Triton imports and EngineConfig.fused_elementwise is on, merged projections, the FP8 matmul
of the GPU's compute capability), that a loaded model's every layer and norm holds the model's ops and the
engine's switch chooses them again, that the loader merges projections exactly where the ops say so, and
that the layers reach the fused kernels through the ops alone: a CPU model handed TritonOps runs them
(under Triton's interpreter) and gives the torch ops' tokens.
"""

import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine, fp8, layer_ops, load_model, triton_jit
from pdserve.engine.layer_ops import CpuOps, CudaOps, TorchOps, TritonOps
from pdserve.engine.models.llama import RMSNorm


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA device of compute capability ``gpu(major, minor)`` as far as the choice asks (no GPU touched)."""
    def set_capability(major: int, minor: int, triton: bool = True):
        monkeypatch.setattr(fp8, "_capability", lambda index: (major, minor))
        monkeypatch.setattr(triton_jit, "available", lambda: triton)
    return set_capability


def test_cpu_gets_packed_linears_and_the_cpp_fp8_kernel():
    ops = layer_ops.choose("cpu")
    assert type(ops) is CpuOps and not ops.merges_projections
    assert ops.fp8_linear is fp8.cpu_linear
    assert type(layer_ops.choose("cpu", fused_elementwise=False)) is CpuOps  # the switch is CUDA's only


@pytest.mark.parametrize("capability,kernel", [((9, 0), fp8.tensor_core_linear), ((8, 9), fp8.tensor_core_linear),
                                               ((8, 0), fp8.widened_linear)])
def test_cuda_gets_triton_merged_projections_and_its_gpus_fp8_matmul(gpu, capability, kernel):
    gpu(*capability)
    ops = layer_ops.choose(torch.device("cuda", 0))
    assert type(ops) is TritonOps and ops.merges_projections and ops.fp8_linear is kernel


def test_cuda_without_the_switch_or_triton_keeps_torch_ops_between_merged_matmuls(gpu):
    gpu(9, 0)
    off = layer_ops.choose("cuda:0", fused_elementwise=False)
    assert type(off) is CudaOps and off.merges_projections
    gpu(9, 0, triton=False)
    assert type(layer_ops.choose("cuda:0")) is CudaOps
    assert type(layer_ops.choose("meta")) is TorchOps  # any other device: the reference, nothing merged
    assert not layer_ops.choose("meta").merges_projections


def test_every_layer_and_norm_holds_the_models_ops_and_the_engine_chooses_them_again():
    loaded = load_model("tiny")
    model = loaded.model
    holders = [m for m in model.modules() if isinstance(getattr(type(m), "ops", None), TorchOps)]
    assert len(holders) == 1 + 4 * 3 + 1  # the model, 4 layers with 2 norms each, the final norm
    assert type(model.ops) is CpuOps and all(m.ops is model.ops for m in holders)
    first = model.ops
    LLMEngine(loaded, EngineConfig(num_blocks=8, fused_elementwise=False))
    assert model.ops is not first and all(m.ops is model.ops for m in holders)


def test_the_loader_merges_projections_where_the_ops_say_so(monkeypatch):
    assert load_model("tiny").model.layers[0].qkv_weight is None  # CPU: separate matrices
    monkeypatch.setattr(layer_ops, "choose", lambda device, fused_elementwise=True: CudaOps())
    layer = load_model("tiny").model.layers[0]
    assert layer.qkv_weight is not None and layer.gate_up_weight is not None
    assert layer.q_proj.weight.data_ptr() == layer.qkv_weight.data_ptr()


def _greedy(loaded, ops) -> tuple[list[int], torch.Tensor]:
    """The model with ``ops``: each position's greedy token and the logits over one prompt."""
    loaded.model.use_ops(ops)
    out = loaded.model.forward_dense(torch.tensor([72, 101, 108, 108, 111, 32, 119]))
    return out.argmax(-1).tolist(), out


def test_the_layers_reach_the_fused_kernels_through_the_ops_alone(monkeypatch):
    """A CPU model given TritonOps runs RMSNorm, rotary and silu*mul as the Triton kernels (interpreted here):
    every call goes through the ops, and the logits are the torch ops' within float32 rounding."""
    loaded = load_model("tiny")
    for layer in loaded.model.layers:
        layer.merge_projections()  # the silu*mul kernel takes the merged gate|up output
    want_tokens, want = _greedy(loaded, TorchOps())
    calls = {"rms_norm": 0, "rope": 0, "silu_mul": 0}
    for name in calls:
        real = getattr(layer_ops.gpu_elementwise, name)

        def counted(*args, name=name, real=real):
            calls[name] += 1
            return real(*args)
        monkeypatch.setattr(layer_ops.gpu_elementwise, name, counted)
    got_tokens, got = _greedy(loaded, TritonOps())
    assert calls == {"rms_norm": 4 * 2 + 1, "rope": 4 * 2, "silu_mul": 4}
    assert got_tokens == want_tokens
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_norm_built_by_hand_runs_the_torch_form():
    norm = RMSNorm(8, 1e-6)
    x = torch.randn(3, 8)
    assert norm.ops is layer_ops.TORCH
    torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
