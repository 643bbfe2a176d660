"""Family config.json fields read as transformers reads them, including the defaults older
files rely on (no ``layer_types``, no soft-capping keys, Gemma 3's old rope keys), checked
against transformers' own config classes; bad values get errors naming them."""

import pytest

from pdserve.engine import ConfigError, ModelConfig

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=112, num_hidden_layers=7, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
CASES = {
    "gemma2-defaults": ("gemma2", "Gemma2ForCausalLM", {}),
    "gemma3-old-rope-keys": ("gemma3_text", "Gemma3ForCausalLM",
                             dict(sliding_window_pattern=3, rope_theta=250000.0, rope_local_base_freq=5000.0,
                                  rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=32)),
    "qwen2-window": ("qwen2", "Qwen2ForCausalLM",
                     dict(use_sliding_window=True, sliding_window=16, max_window_layers=3)),
    "qwen3-window": ("qwen3", "Qwen3ForCausalLM",
                     dict(use_sliding_window=True, sliding_window=16, max_window_layers=5)),
    "qwen3-no-window": ("qwen3", "Qwen3ForCausalLM", dict(use_sliding_window=False, sliding_window=16)),
    "mistral-default-window": ("mistral", "MistralForCausalLM", {}),
    "qwen3moe-local-experts": ("qwen3_moe", "Qwen3MoeForCausalLM",
                               dict(num_local_experts=6, num_experts_per_tok=3, moe_intermediate_size=8,
                                    decoder_sparse_step=2, mlp_only_layers=[3])),
}


def _theirs(model_type, fields):
    return transformers.AutoConfig.for_model(model_type, **BASE, **fields)


@pytest.mark.parametrize("case", list(CASES))
def test_fields_match_transformers_config(case):
    model_type, arch, fields = CASES[case]
    ours = ModelConfig.from_hf_dict({"architectures": [arch], "model_type": model_type, **BASE, **fields})
    theirs = _theirs(model_type, fields)
    window = getattr(theirs, "sliding_window", None)
    layer_types = getattr(theirs, "layer_types", None)
    if model_type in ("mistral", "qwen3_moe") and window is not None:  # their attention windows every layer
        layer_types = ["sliding_attention"] * BASE["num_hidden_layers"]
    expected = [window if t == "sliding_attention" else None for t in (layer_types or [None] * 7)]
    assert [ours.layer_window(i) for i in range(ours.num_layers)] == expected
    if model_type.startswith("gemma"):
        assert ours.hidden_act == theirs.hidden_activation
        assert ours.query_pre_attn_scalar == theirs.query_pre_attn_scalar
        assert ours.final_logit_softcapping == theirs.final_logit_softcapping
        assert ours.tie_word_embeddings and theirs.tie_word_embeddings
    if model_type == "gemma2":
        assert ours.attn_logit_softcapping == theirs.attn_logit_softcapping == 50.0
    if model_type == "gemma3_text":
        rope = theirs.rope_parameters
        assert ours.rope_theta == rope["full_attention"]["rope_theta"] == 250000.0
        assert ours.rope_local_theta == rope["sliding_attention"]["rope_theta"] == 5000.0
        assert ours.rope_scaling["factor"] == rope["full_attention"]["factor"] == 8.0
    if model_type == "qwen3_moe":
        assert ((ours.num_experts, ours.num_experts_per_tok)
                == (theirs.num_experts, theirs.num_experts_per_tok) == (6, 3))
        sparse = [i not in theirs.mlp_only_layers and (i + 1) % theirs.decoder_sparse_step == 0 for i in range(7)]
        assert [ours.is_moe_layer(i) for i in range(7)] == sparse


@pytest.mark.parametrize("change, message", [
    (dict(hidden_act="relu"), "unsupported hidden_act 'relu'"),
    (dict(layer_types=["full_attention"] * 3), "layer_types has 3 entries for 2 layers"),
    (dict(layer_types=["chunked_attention"] * 2, sliding_window=4), "unsupported layer type 'chunked_attention'"),
    (dict(layer_types=["sliding_attention"] * 2), "sliding_window is not set"),
    (dict(architecture="Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8),
     "num_experts_per_tok must be in 1..num_experts"),
])
def test_bad_family_values_are_named(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=2, num_kv_heads=1,
                    **change)


def test_to_hf_dict_refuses_families_it_cannot_write():
    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=2, num_kv_heads=1,
                      architecture="Qwen3ForCausalLM")
    with pytest.raises(ConfigError, match="to_hf_dict writes Llama/Qwen2/Mistral configs"):
        cfg.to_hf_dict()
