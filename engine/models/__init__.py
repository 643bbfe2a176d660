"""The decoder layer of each model family (see ``engine/config.py`` SUPPORTED_ARCHITECTURES).

``layer_class(cfg)`` -> the layer ``DecoderModel`` stacks: ``llama.py`` (Llama, Mistral,
Qwen2: the base every other layer extends), ``qwen3.py`` (q/k norms), ``qwen3_moe.py``
(experts), ``gemma.py`` (Gemma 2 and 3). A new family: a module with a ``DecoderLayer``
subclass, a row in ``LAYERS``, a row in SUPPORTED_ARCHITECTURES, its config fields in
``config_families.py``.
"""

from __future__ import annotations

from ..config import ModelConfig
from .gemma import GemmaLayer
from .llama import DecoderLayer
from .qwen3 import Qwen3Layer
from .qwen3_moe import Qwen3MoeLayer

# family (engine/config.py) -> its layer
LAYERS: dict[str, type[DecoderLayer]] = {
    "llama": DecoderLayer,
    "mistral": DecoderLayer,
    "qwen2": DecoderLayer,
    "qwen3": Qwen3Layer,
    "qwen3_moe": Qwen3MoeLayer,
    "gemma2": GemmaLayer,
    "gemma3": GemmaLayer,
}


def layer_class(cfg: ModelConfig) -> type[DecoderLayer]:
    return LAYERS[cfg.family]
