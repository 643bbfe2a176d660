"""What each model family adds to ModelConfig, read from its config.json the way transformers reads it.

``family_fields(family, cfg)`` -> extra ModelConfig keyword arguments (activation, sliding
window and which layers use it, Gemma's attention scale and soft-capping, Gemma 3's local
rotary base, Qwen3-MoE's experts). Defaults are transformers' for a field the file leaves out,
so an older config.json means what it means there. Torch-free.
"""

from __future__ import annotations

from .errors import ConfigError

# head_dim when config.json leaves it out (transformers' class defaults; others: hidden / heads)
DEFAULT_HEAD_DIM = {"qwen3": 128, "gemma2": 256, "gemma3": 256}
DEFAULT_ROPE_THETA = {"gemma3": 1_000_000.0}


def family_fields(family: str, cfg: dict) -> dict:
    n = cfg.get("num_hidden_layers", 0)
    if family.startswith("gemma"):
        return _gemma(family, cfg, n)
    out: dict = {"hidden_act": cfg.get("hidden_act", "silu")}
    if family == "mistral":  # one window on every layer (transformers' default 4096 if the key is absent)
        window = cfg.get("sliding_window", 4096 if cfg.get("model_type") == "mistral" else None)
        out.update(_all_layers(window, n))
    elif family in ("qwen2", "qwen3", "qwen3_moe"):
        window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
        if family == "qwen3_moe":  # its attention takes the window on every layer
            out.update(_all_layers(window, n))
        elif cfg.get("layer_types") is not None:
            out.update(sliding_window=window, layer_types=list(cfg["layer_types"]))
        elif window is not None:
            first = cfg.get("max_window_layers", 28)
            out.update(sliding_window=window, layer_types=[_kind(i >= first) for i in range(n)])
    if family == "qwen3_moe":
        out.update(
            num_experts=cfg.get("num_experts", cfg.get("num_local_experts", 128)),
            num_experts_per_tok=cfg.get("num_experts_per_tok", 8),
            moe_intermediate_size=cfg.get("moe_intermediate_size", 768),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
            mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
        )
    return out


def _kind(sliding: bool) -> str:
    return "sliding_attention" if sliding else "full_attention"


def _all_layers(window: int | None, n: int) -> dict:
    return {} if window is None else {"sliding_window": window, "layer_types": [_kind(True)] * n}


def _gemma(family: str, cfg: dict, n: int) -> dict:
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention is not supported (the engine decodes causally)")
    layer_types = cfg.get("layer_types")
    if layer_types is None:  # Gemma 2 alternates sliding/full; Gemma 3: every `pattern`-th layer is full
        pattern = 2 if family == "gemma2" else cfg.get("sliding_window_pattern", 6)
        layer_types = [_kind(bool((i + 1) % pattern)) for i in range(n)]
    out = {
        "hidden_act": cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
        "sliding_window": cfg.get("sliding_window", 4096),
        "layer_types": list(layer_types),
    }
    if family == "gemma2":
        out["attn_logit_softcapping"] = cfg.get("attn_logit_softcapping", 50.0)
        out["final_logit_softcapping"] = cfg.get("final_logit_softcapping", 30.0)
        return out
    # Gemma 3: transformers applies no attention soft-capping (the field is read but not used)
    out["final_logit_softcapping"] = cfg.get("final_logit_softcapping")
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ConfigError(f"unsupported rope type {local['rope_type']!r} for the sliding layers")
    out["rope_local_theta"] = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0)))
    return out
