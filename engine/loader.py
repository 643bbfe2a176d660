"""load_model: a built-in name or a Hugging Face directory -> LoadedModel (weights + tokenizer).

- ``"tiny"`` / ``"builtin:tiny"`` (``engine/defaults.py`` BUILTIN_MODEL): a small Llama with
  deterministic random weights from ``seed`` and the byte-level tokenizer. No files, no download.
- A directory: ``config.json`` (unknown architecture -> ConfigError naming it), weights from
  ``model.safetensors`` or shards listed in ``model.safetensors.index.json`` (a missing or
  mis-shaped tensor -> ModelLoadError naming it), ``tokenizer.json`` (+ ``tokenizer_config.json``
  for the chat template). A directory without tokenizer.json gets the byte-level tokenizer.
- Quantization: config.json's ``quantization_config`` is read first (``quant_config.py``: FP8 loads,
  anything else is refused by name before a weight is read); ``quantization="fp8"``
  (``--quantization fp8``) quantizes a plain model's projections at load. Weights are read and
  checked by ``weight_source.py``; FP8 projections keep a ``*_scale`` buffer beside them (``fp8.py``).
- Tensor parallelism: ``tensor_parallel_size=N, rank=r`` loads rank r's shard only (``tp/shard.py``: the
  rows or columns of each checkpoint tensor it holds, read as slices of the safetensors; the built-in
  model's random tensors are made whole and sliced, so every N gives the same weights). ``LoadedModel.source``
  is how to load it again, which the other ranks do (``tp/worker.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .defaults import BUILTIN_MODEL

from .checkpoint import hf_tensor_shapes, random_hf_weights
from . import fp8, layer_ops
from .config import ModelConfig, read_config_json
from .errors import ModelLoadError
from .quant_config import QuantScheme, read_quantization
from .weight_memory import build_within_memory
from .weight_source import WeightSource, shape_error
from .model import DecoderModel
from .models import layer_class
from .tokenizer import ByteTokenizer, HFTokenizer
from .tp.shard import Shard

log = logging.getLogger(__name__)
BUILTIN_NAMES = (BUILTIN_MODEL, f"builtin:{BUILTIN_MODEL}")


def tiny_config() -> ModelConfig:
    """The built-in model's shape: 4 layers, hidden 64, GQA 4 heads / 2 KV heads, byte vocabulary."""
    return ModelConfig(
        vocab_size=ByteTokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=176,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        architecture="LlamaForCausalLM",
        bos_token_id=ByteTokenizer.BOS,
        eos_token_ids=[ByteTokenizer.EOS],
    )


@dataclass(frozen=True, slots=True)
class ModelSource:
    """``load_model``'s arguments: what another tensor-parallel rank needs to load its own shard."""

    name_or_path: str
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    seed: int = 0
    quantization: str | None = None


@dataclass
class LoadedModel:
    """What ``load_model`` returns: the shape, the torch module (eval mode), the tokenizer. With tensor
    parallelism ``model`` is this rank's shard (``shard.config`` its shape) and ``config`` the whole model's."""

    name: str
    config: ModelConfig
    model: DecoderModel
    tokenizer: ByteTokenizer | HFTokenizer
    dtype: torch.dtype
    device: torch.device
    quantization: QuantScheme | None = None  # FP8 projections (fp8.py), or None
    shard: Shard | None = None  # None: the whole model (tensor-parallel size 1)
    source: ModelSource | None = None  # how it was loaded (None: built by hand, not loadable by other ranks)

    @property
    def tensor_parallel_size(self) -> int:
        return 1 if self.shard is None else self.shard.size


# our parameter name -> the HF tensors concatenated (dim 0) to make it
def _param_sources(cfg: ModelConfig) -> dict[str, list[str]]:
    src = {"embed_tokens.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    layer_cls = layer_class(cfg)
    for i in range(cfg.num_layers):
        for param, sources in layer_cls.checkpoint_tensors(cfg, i).items():
            src[f"layers.{i}.{param}"] = [f"model.layers.{i}.{name}" for name, _ in sources]
    if not cfg.tie_word_embeddings:
        src["lm_head.weight"] = ["lm_head.weight"]
    return src


_INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
                   "trunc_normal_", "zeros_", "ones_", "constant_")


@contextlib.contextmanager
def _no_random_init():
    """torch.nn's modules skip their random init while the model is built on the meta device (every
    weight comes from the checkpoint next). On meta that init still ran torch's Python reference ops,
    whose first use imports torch._dynamo: about 2.4 s of every server's start on this CPU, for
    nothing. Patched for the constructor only, as transformers' ``no_init_weights`` does."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in _INIT_FUNCTIONS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def build_model(cfg: ModelConfig, get_tensor, dtype: torch.dtype, device: torch.device,
                scheme: QuantScheme | None = None, shard: Shard | None = None) -> DecoderModel:
    """A DecoderModel whose weights come from ``get_tensor(hf_name) -> Tensor`` (shapes checked); with
    ``scheme``, its layers' projections are FP8 (``weight_source.py``; each ``*_scale`` beside them). With
    ``shard``, the rank's part of each tensor (``get_tensor`` may return a safetensors slice)."""
    shard = shard or Shard(0, 1, cfg)
    with torch.device("meta"), _no_random_init():
        model = DecoderModel(shard.config, vocab_rows=shard.vocab_rows)
    model.to_empty(device=device)
    tied = cfg.tie_word_embeddings
    if tied and shard.size == 1:  # to_empty may untie; tie again before filling
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters())
    sources_of = _param_sources(cfg)
    unfilled = set(params) - set(sources_of) - ({"lm_head.weight"} if tied else set())
    if unfilled:  # a programming error here, not a user one: never run on uninitialised memory
        raise RuntimeError(f"no checkpoint source for parameters {sorted(unfilled)}")
    full_shapes = hf_tensor_shapes(cfg)
    source = WeightSource(_sharded(get_tensor, shard, full_shapes),
                          {name: shard.shape(name, shape) for name, shape in full_shapes.items()},
                          scheme, dtype, device)
    quantized = layer_class(cfg).QUANTIZED_PARAMS
    for name, sources in sources_of.items():
        fp8_capable = scheme is not None and name.startswith("layers.") and name.split(".", 2)[2] in quantized
        value, scale = source.load(name, sources, fp8_capable)
        with torch.no_grad():
            params[name].data = value
        if scale is not None:
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner).register_buffer(f"{attr}_scale", scale)
    if tied:  # the embedding's rows of this rank's vocabulary (all of them at size 1)
        model.lm_head.weight = shard.tied_head(model.embed_tokens.weight)
    if scheme is not None:
        log.info("FP8 weights (%s): %d projections, %.2f GiB (%.2f GiB in %s); matmuls: %s", scheme.method,
                 source.fp8_params, source.fp8_bytes / 2**30, source.fp8_bytes * dtype.itemsize / 2**30,
                 str(dtype).removeprefix("torch."), fp8.describe(torch.device(device)))
        if scheme.static_activations:
            log.info("the checkpoint's static input scales are not used: activations are quantized per token at "
                     "run time where the matmuls are FP8")
    model.init_rope()
    ops = layer_ops.choose(device)  # once for the model (the engine's switches may choose again: configure)
    model.use_ops(ops)  # CPU: packed copies of the linear weights (packed_linear.py)
    if ops.merges_projections:  # CUDA: one matmul for q|k|v and one for gate|up (models/llama.py)
        for layer in model.layers:
            layer.merge_projections()
    return model.eval().requires_grad_(False)


def _sharded(get_tensor, shard: Shard, full_shapes: dict[str, tuple[int, ...]]):
    """``get_tensor`` giving ``shard``'s part of each tensor, the whole tensor's shape checked first."""
    if shard.size == 1:
        return get_tensor

    def get(name: str) -> torch.Tensor:
        whole = get_tensor.slice(name) if hasattr(get_tensor, "slice") else get_tensor(name)
        shape = tuple(whole.get_shape()) if hasattr(whole, "get_shape") else tuple(whole.shape)
        if name in full_shapes and shape != full_shapes[name]:
            raise shape_error(name, shape, full_shapes[name])
        return shard.take(name, whole, shape)

    return get


class _SafetensorsReader:
    """Reads tensors by name from a single file or an index of shards; names what is missing."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        self.directory = directory
        index = directory / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise ModelLoadError(f"{index} is not a valid safetensors index: {exc}") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
            if not files:
                raise ModelLoadError(f"no .safetensors weights in {directory}")
            weight_map = None
        self._handles = {}
        for f in files:
            path = directory / f
            if not path.exists():
                raise ModelLoadError(f"weight shard {f!r} listed in the index is missing from {directory}")
            self._handles[f] = safe_open(str(path), framework="pt")
        if weight_map is None:
            weight_map = {k: f for f, h in self._handles.items() for k in h.keys()}
        self.weight_map = weight_map

    def __call__(self, name: str) -> torch.Tensor:
        f = self.weight_map.get(name)
        if f is None or name not in self._handles[f].keys():
            raise ModelLoadError(f"weight {name!r} is missing from the checkpoint in {self.directory}")
        return self._handles[f].get_tensor(name)

    def slice(self, name: str):
        """The tensor ``name`` unread: index it (``[a:b]``, ``[:, a:b]``) to read only those rows or columns."""
        f = self.weight_map.get(name)
        if f is None or name not in self._handles[f].keys():
            raise ModelLoadError(f"weight {name!r} is missing from the checkpoint in {self.directory}")
        return self._handles[f].get_slice(name)


def load_model(
    name_or_path: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    quantization: str | None = None,
    tensor_parallel_size: int = 1,
    rank: int = 0,
) -> LoadedModel:
    """Load the built-in model (``"tiny"``, ``"builtin:tiny"``) or a Hugging Face directory.

    ``quantization``: "fp8" quantizes the weights at load (``--quantization``); a checkpoint's own
    ``quantization_config`` is read from config.json (``quant_config.py``) and refused unless supported.
    ``tensor_parallel_size`` > 1: only rank ``rank``'s shard (``tp/shard.py``; ShardError, a ValueError,
    when the model cannot be split so), on ``device`` (rank 0's; rank r's is ``tp.rank_device``)."""
    source = ModelSource(name_or_path, dtype, str(device), seed, quantization)
    device = torch.device(device)
    if name_or_path in BUILTIN_NAMES:
        scheme = read_quantization({}, quantization)
        cfg = tiny_config()
        shard = Shard(rank, tensor_parallel_size, cfg)
        weights = random_hf_weights(cfg, seed=seed)
        # Only printable ASCII, newline and EOS get random output weights; every other byte
        # gets logit 0 and rarely wins, so the built-in model's text is printable gibberish.
        keep = [10, *range(32, 127), ByteTokenizer.EOS]
        mask = torch.zeros(cfg.vocab_size, 1)
        mask[keep] = 1.0
        weights["lm_head.weight"] = weights["lm_head.weight"] * mask * 20
        model = _build_on_device(cfg, weights.__getitem__, dtype, device, scheme, shard)
        return LoadedModel(BUILTIN_MODEL, cfg, model, ByteTokenizer(), dtype, device, scheme, shard, source)
    path = Path(name_or_path)
    if not path.is_dir():
        raise ModelLoadError(
            f"model {name_or_path!r} is neither a built-in model ({', '.join(BUILTIN_NAMES)}) nor a directory"
        )
    hf_config = read_config_json(path / "config.json")
    cfg = ModelConfig.from_hf_dict(hf_config)
    shard = Shard(rank, tensor_parallel_size, cfg)
    scheme = read_quantization(hf_config, quantization)
    model = _build_on_device(cfg, _SafetensorsReader(path), dtype, device, scheme, shard)
    tokenizer = HFTokenizer(path, cfg.eos_token_ids) if (path / "tokenizer.json").exists() else ByteTokenizer()
    return LoadedModel(path.name, cfg, model, tokenizer, dtype, device, scheme, shard, source)


def _build_on_device(cfg: ModelConfig, get_tensor, dtype: torch.dtype, device: torch.device, scheme, shard: Shard):
    """build_model, within the device's free memory (``weight_memory.build_within_memory``: on CUDA a model too
    large is refused naming the sizes before anything is allocated)."""
    return build_within_memory(lambda: build_model(cfg, get_tensor, dtype, device, scheme, shard), cfg, dtype,
                               scheme, shard, device)
