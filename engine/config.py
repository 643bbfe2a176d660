"""ModelConfig: the decoder's shape, read from a Hugging Face ``config.json``.

Only the Llama/Qwen2 family is supported (see ``SUPPORTED_ARCHITECTURES``); anything else
is refused with an error naming the architecture. Rotary scaling types other than
``linear`` and ``llama3`` (and no scaling) are refused with an error naming the type.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

# HF `architectures` entry -> our family name (they differ only in the q/k/v bias default).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "llama",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
    """A config.json the engine cannot run (unknown architecture, bad values)."""


@dataclass(slots=True)
class ModelConfig:
    """Shape of a Llama/Qwen2-family decoder. Validated on construction."""

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
            default_bias = SUPPORTED_ARCHITECTURES[arch] == "qwen2"
            rope_scaling = cfg.get("rope_scaling")
            rope_theta = cfg.get("rope_theta")
            # transformers >= 5 writes rope settings as `rope_parameters`
            params = cfg.get("rope_parameters")
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
                head_dim=cfg.get("head_dim") or 0,
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
                rope_scaling=rope_scaling,
                attention_bias=bool(cfg.get("attention_bias", default_bias)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                architecture=arch,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as exc:
            raise ConfigError(f"config.json is missing the field {exc.args[0]!r}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_hf_dict(data)

    def to_hf_dict(self) -> dict:
        """The config.json transformers needs to build the same model (used by tests and benchmarks)."""
        out = {
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


def rope_inv_freq(config: ModelConfig) -> "torch.Tensor":
    """Inverse rotary frequencies (float32, one per pair of dims), with the config's scaling applied."""
    import torch

    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    rope_type = "default" if not scaling else scaling.get("rope_type", scaling.get("type", "default"))
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
