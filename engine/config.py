"""ModelConfig: the decoder's shape, read from a Hugging Face ``config.json``.

The architectures in ``SUPPORTED_ARCHITECTURES`` are supported (Llama, Mistral, Qwen2, Qwen3,
Qwen3-MoE, Gemma 2, Gemma 3 text); anything else is refused with an error naming the
architecture. What differs per family (q/k norms, Gemma's norms and soft-capping, sliding
windows, experts) is read by ``config_families.py``. Rotary scaling types other than
``linear`` and ``llama3`` (and no scaling) are refused with an error naming the type.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config_families import DEFAULT_HEAD_DIM, DEFAULT_ROPE_THETA, family_fields
from .errors import ConfigError

if TYPE_CHECKING:
    import torch

# HF `architectures` entry -> our family name (engine/models/__init__.py maps it to its layers).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(slots=True)
class ModelConfig:
    """Shape of a supported decoder (see ``SUPPORTED_ARCHITECTURES``). Validated on construction."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0 -> hidden_size // num_heads
    max_position_embeddings: int = 2048  # the context length
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    tie_word_embeddings: bool = False
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    hidden_act: str = "silu"  # the MLP's gate activation
    # sliding-window attention: layer i attends to the last `sliding_window` positions (itself
    # included) when layer_types[i] == "sliding_attention"; layer_types None -> all full
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 (Gemma); None: head_dim
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # the same on the LM head's logits
    rope_local_theta: float | None = None  # Gemma 3: sliding layers' rotary base (unscaled); None: rope_theta
    # mixture of experts (Qwen3-MoE): layer i is sparse unless in mlp_only_layers or (i+1) % step
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ConfigError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
            self.head_dim = self.hidden_size // self.num_heads
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.max_position_embeddings <= 0:
            raise ConfigError(f"max_position_embeddings must be positive, got {self.max_position_embeddings}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ConfigError(
                    f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
                )
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ConfigError(
                f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
            bad = [t for t in self.layer_types if t not in LAYER_TYPES]
            if bad:
                raise ConfigError(f"unsupported layer type {bad[0]!r}; supported: {', '.join(LAYER_TYPES)}")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ConfigError("layer_types asks for sliding_attention but sliding_window is not set")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(
                    f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}), got "
                    f"{self.num_experts_per_tok}"
                )
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise ConfigError("moe_intermediate_size and decoder_sparse_step must be positive")

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window (positions it sees, itself included), or None for full attention."""
        if self.layer_types is None or self.layer_types[i] != "sliding_attention":
            return None
        return self.sliding_window

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def context_length(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        """Build from the dict of a Hugging Face config.json."""
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        unknown = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
        if unknown:
            raise ConfigError(
                f"unsupported architecture {unknown[0]!r} in config.json; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]
        try:
            num_heads = cfg["num_attention_heads"]
            eos = cfg.get("eos_token_id")
            eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
            family = SUPPORTED_ARCHITECTURES[arch]
            default_bias = family == "qwen2"
            rope_scaling = cfg.get("rope_scaling")
            rope_theta = cfg.get("rope_theta")
            # transformers >= 5 writes rope settings as `rope_parameters`
            params = cfg.get("rope_parameters")
            if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
                params = params["full_attention"]  # Gemma 3: one entry per layer type (local: family_fields)
            if isinstance(params, dict):
                rope_theta = params.get("rope_theta", rope_theta)
                if params.get("rope_type", "default") != "default":
                    rope_scaling = rope_scaling or params
            return cls(
                vocab_size=cfg["vocab_size"],
                hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"],
                num_layers=cfg["num_hidden_layers"],
                num_heads=num_heads,
                num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
                head_dim=cfg.get("head_dim") or DEFAULT_HEAD_DIM.get(family, 0),
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope_theta if rope_theta is not None else DEFAULT_ROPE_THETA.get(family, 10000.0)),
                rope_scaling=rope_scaling,
                attention_bias=bool(cfg.get("attention_bias", default_bias)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family.startswith("gemma"))),
                architecture=arch,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                **family_fields(family, cfg),
            )
        except KeyError as exc:
            raise ConfigError(f"config.json is missing the field {exc.args[0]!r}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        return cls.from_hf_dict(read_config_json(path))

    def to_hf_dict(self) -> dict:
        """The config.json transformers needs to build the same model (used by tests and benchmarks).

        Llama/Qwen2/Mistral only: other families' checkpoints are written by transformers."""
        if self.family not in ("llama", "qwen2", "mistral"):
            raise ConfigError(f"to_hf_dict writes Llama/Qwen2/Mistral configs, not {self.architecture!r}")
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": "qwen2" if SUPPORTED_ARCHITECTURES[self.architecture] == "qwen2" else "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            out["eos_token_id"] = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids
        return out


def read_config_json(path: str | Path) -> dict:
    """The dict of a config.json; ConfigError when it is missing or not a JSON object."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no config.json at {path}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return data


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse rotary frequencies (float32, one per pair of dims), with the config's scaling applied.

    ``local``: Gemma 3's sliding layers (base ``rope_local_theta``, never scaled)."""
    import torch

    dim = config.head_dim
    theta = config.rope_local_theta if local and config.rope_local_theta is not None else config.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = None if local else config.rope_scaling
    if not scaling:
        return inv
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv / factor
    # llama3: low frequencies divided by `factor`, high ones kept, a smooth ramp in between
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_freq_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
