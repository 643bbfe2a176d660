"""The controller's view of a model: its shape and tokenizer, without loading any weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.config import ModelConfig
from pdserve.engine.errors import ModelLoadError
from pdserve.engine.loader import BUILTIN_NAMES, tiny_config
from pdserve.engine.tokenizer import ByteTokenizer, HFTokenizer


@dataclass
class ModelMeta:
    config: ModelConfig
    tokenizer: ByteTokenizer | HFTokenizer


def load_meta(name_or_path: str) -> ModelMeta:
    """``load_model``'s config and tokenizer for the same name or directory (same errors)."""
    if name_or_path in BUILTIN_NAMES:
        return ModelMeta(tiny_config(), ByteTokenizer())
    path = Path(name_or_path)
    if not path.is_dir():
        raise ModelLoadError(
            f"model {name_or_path!r} is neither a built-in model ({', '.join(BUILTIN_NAMES)}) nor a directory"
        )
    cfg = ModelConfig.from_file(path / "config.json")
    tok = HFTokenizer(path, cfg.eos_token_ids) if (path / "tokenizer.json").exists() else ByteTokenizer()
    return ModelMeta(cfg, tok)
