"""DecoderLayer.merge_projections (what the loader does where the model's ops merge: CUDA): q|k|v and
gate|up as one matrix each, the separate weights views into them. Run here on CPU by merging by hand: the
same greedy tokens and logits as the separate matmuls (float32), no memory added, and
EngineConfig(merged_projections=False) back on the separate path. Families: Qwen2 (q/k/v biases), Qwen3
(q/k norms over the split views), Gemma 2 (its own MLP placement), Qwen3-MoE (dense layers merge gate|up;
MoE layers keep their experts)."""

import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine, load_model
from harness.engine_runs import greedy_with_first_logits
from harness.hf_checkpoints import build_from_config, build_tiny

PROMPTS = [[5, 9, 13, 2, 7, 11, 3, 8, 1], list(range(3, 33))]


def _checkpoint(family: str, path):
    if family == "qwen2":
        hf = build_from_config("Qwen2Config", {}, "Qwen2ForCausalLM", seed=5)
    else:
        hf = build_tiny(family, seed=5)
    hf.save_pretrained(str(path))
    return str(path)


def _run(loaded, **switches):
    """(greedy tokens per prompt, first-step logits) through one engine."""
    return greedy_with_first_logits(LLMEngine(loaded, EngineConfig(num_blocks=48, block_size=8, **switches)),
                                    PROMPTS, 12)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma2", "qwen3_moe"])
def test_merged_projections_give_the_separate_results(family, tmp_path, monkeypatch):
    torch.set_num_threads(1)
    path = _checkpoint(family, tmp_path)
    want_tokens, want_logits = _run(load_model(path))
    merged = load_model(path)
    params_before = sum(p.numel() for p in merged.model.parameters())
    for layer in merged.model.layers:
        layer.merge_projections()
    layer = merged.model.layers[0]
    assert layer.qkv_weight is not None
    assert layer.q_proj.weight.data_ptr() == layer.qkv_weight.data_ptr()  # a view: no memory added
    assert sum(p.numel() for p in merged.model.parameters()) == params_before
    assert (layer.qkv_bias is not None) == (family == "qwen2")
    dense = [x for x in merged.model.layers if hasattr(x, "gate_proj")]
    assert all(x.gate_up_weight is not None for x in dense) and (family != "qwen3_moe" or len(dense) < 3)
    got_tokens, got_logits = _run(merged)
    assert got_tokens == want_tokens
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    off_tokens, off_logits = _run(merged, merged_projections=False)  # EngineConfig's switch: separate matmuls
    assert not merged.model.layers[0].merged
    assert off_tokens == want_tokens and torch.equal(off_logits, want_logits)
