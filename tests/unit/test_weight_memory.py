"""A model too large for its GPU is refused at load naming the sizes (weight_memory.py), instead of a CUDA
out-of-memory traceback: the byte count is the loaded model's own, plain and FP8, and the message says what
to try. (The CUDA memory query itself runs on a GPU: tools/gpu/check.py loads the 8B shape that way.)"""

import pytest
import torch

from pdserve.engine import ModelConfig, ModelLoadError, load_model
from pdserve.engine.quant_config import QuantScheme
from pdserve.engine.tp.shard import Shard
from pdserve.engine.weight_memory import GIB, check_fits, weight_bytes, where


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


LLAMA_70B = ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                        num_kv_heads=8, head_dim=128)


@pytest.mark.parametrize("quantization", [None, "fp8"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_ranks_bytes_are_its_loaded_shards(rank, quantization):
    """At tensor-parallel size 2 each rank loads its heads, MLP rows and LM-head rows (the last rank's padded);
    the count is that shard's, not the whole model's (nor the whole model's divided by 2: the embedding and norms
    are whole on every rank)."""
    loaded = load_model("tiny", quantization=quantization, tensor_parallel_size=2, rank=rank)
    scheme = QuantScheme("online-fp8") if quantization else None
    shard_bytes = weight_bytes(loaded.config, torch.float32, scheme, loaded.shard)
    assert shard_bytes == _loaded_bytes(loaded.model)
    whole = weight_bytes(loaded.config, torch.float32, scheme)
    assert whole / 2 < shard_bytes < whole


def test_the_70b_shape_per_rank_at_tensor_parallel_4_and_8():
    whole = weight_bytes(LLAMA_70B, torch.bfloat16)
    assert 131.0 < whole / GIB < 131.6  # 70.6 B parameters in bf16
    per_rank = {n: weight_bytes(LLAMA_70B, torch.bfloat16, None, Shard(0, n, LLAMA_70B)) for n in (1, 2, 4, 8)}
    assert per_rank[1] == whole
    replicated = (128256 + (2 * 80 + 1)) * 8192 * 2  # the embedding and the norms: whole on every rank
    for n in (2, 4, 8):  # the rest divides by n exactly (128256 vocabulary rows divide by 8)
        assert per_rank[n] - replicated == (whole - replicated) // n
    assert 34.0 < per_rank[4] / GIB < 34.6 and 18.0 < per_rank[8] / GIB < 18.3  # fits an 80 GB GPU with room for KV


def test_a_rank_that_does_not_fit_is_refused_naming_the_rank_the_size_and_both_byte_counts():
    shard = Shard(1, 2, LLAMA_70B)
    need, whole = weight_bytes(LLAMA_70B, torch.bfloat16, None, shard), weight_bytes(LLAMA_70B, torch.bfloat16)
    on = where("cuda:1", shard, whole)
    assert on == "cuda:1 (tensor-parallel rank 1 of 2: its shard of the model's 131.4 GiB)"
    check_fits(need, 79 * GIB, 80 * GIB, on)  # 67 GiB fit an 80 GB GPU
    with pytest.raises(ModelLoadError, match=r"the model's weights need 66.7 GiB on cuda:1 \(tensor-parallel rank 1 of "
                                             r"2: its shard of the model's 131.4 GiB\), 39.0 GiB free of 39.4 GiB: use "
                                             r"a GPU with more memory, more tensor-parallel ranks \(--tensor-parallel-"
                                             r"size; an InferenceService pool's parallelism.tensor"):
        check_fits(need, int(39.0 * GIB), int(39.4 * GIB), on)
    assert where("cuda:0", Shard(0, 1, LLAMA_70B), whole) == "cuda:0"  # size 1: as before


def test_the_loader_checks_each_rank_against_its_own_gpu(monkeypatch):
    """The loader's CUDA path (loader._build_on_device) asks its rank's GPU for free memory and refuses before
    anything is allocated. (The CUDA query is the one stand-in here: no GPU on this machine.)"""
    from pdserve.engine import loader

    asked = []

    def mem_get_info(device):
        asked.append(str(device))
        return int(39.0 * GIB), int(39.4 * GIB)

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)

    def never(name):
        raise AssertionError(f"read {name} before the check")

    with pytest.raises(ModelLoadError, match=r"need 66.7 GiB on cuda:1 \(tensor-parallel rank 1 of 2: its shard of "
                                             r"the model's 131.4 GiB\), 39.0 GiB free"):
        loader._build_on_device(LLAMA_70B, never, torch.bfloat16, torch.device("cuda:1"), None,
                                Shard(1, 2, LLAMA_70B))
    assert asked == ["cuda:1"]
    with pytest.raises(ModelLoadError, match=r"need 131.4 GiB on cuda:0, 39.0 GiB free of 39.4 GiB: use a GPU with "
                                             r"more memory, --quantization fp8"):
        loader._build_on_device(LLAMA_70B, never, torch.bfloat16, torch.device("cuda:0"), None, Shard(0, 1, LLAMA_70B))
