"""A model too large for its GPU is refused at load naming the sizes (weight_memory.py), instead of a CUDA
out-of-memory traceback: the byte count is the loaded model's own, plain and FP8, and the message says what
to try. (The CUDA memory query itself runs on a GPU: tools/gpu/check.py loads the 8B shape that way.)"""

import pytest
import torch

from pdserve.engine import ModelConfig, ModelLoadError, load_model
from pdserve.engine.quant_config import QuantScheme
from pdserve.engine.weight_memory import GIB, check_fits, weight_bytes


def _loaded_bytes(model) -> int:
    """Every parameter once (a tied LM head is the embedding) and the FP8 scales beside them."""
    tensors = [*model.parameters(), *(b for n, b in model.named_buffers() if n.endswith("_scale"))]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("quantization", [None, "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_bytes_are_the_loaded_models(dtype, quantization):
    loaded = load_model("tiny", dtype=dtype, quantization=quantization)
    scheme = QuantScheme("online-fp8") if quantization else None
    assert weight_bytes(loaded.config, dtype, scheme) == _loaded_bytes(loaded.model)


def test_the_8b_shape_in_bf16_and_fp8():
    cfg = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128)
    bf16 = weight_bytes(cfg, torch.bfloat16)
    fp8 = weight_bytes(cfg, torch.bfloat16, QuantScheme("online-fp8"))
    assert 14.9 < bf16 / GIB < 15.0  # 8.03 B parameters
    assert 0.5 < fp8 / bf16 < 0.6  # projections halved; embeddings and LM head stay bf16


def test_a_model_that_does_not_fit_is_refused_naming_the_sizes():
    check_fits(10 * GIB, 11 * GIB, 80 * GIB, "cuda:0")  # fits: nothing said
    with pytest.raises(ModelLoadError, match=r"the model's weights need 15.0 GiB on cuda:0, 9.5 GiB free of "
                                             r"79.1 GiB: use a GPU with more memory, --quantization fp8"):
        check_fits(int(15.0 * GIB), int(9.5 * GIB), int(79.1 * GIB), "cuda:0")
