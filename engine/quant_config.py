"""What a checkpoint's ``quantization_config`` says, read at load and refused unless supported.

``read_quantization(hf_config, requested)`` -> a ``QuantScheme`` or None (a plain checkpoint).
It reads ``quantization_config`` (or its older name ``compression_config``) from config.json.

Supported (every other method, format or scheme raises ConfigError naming it and what is supported,
before any weight is read, so that no checkpoint loads wrong):

- ``fp8`` (vLLM / AutoFP8 layout): ``weight`` float8_e4m3fn with a per-tensor ``weight_scale``;
  ``activation_scheme`` dynamic or static (a static ``input_scale`` is not used: activations are
  quantized per token at run time, which is finer). Block-wise fp8 (``weight_block_size``) is refused.
- ``compressed-tensors`` (llm-compressor) with format ``float-quantized``: every config group FP8
  (8-bit ``float``, symmetric) with ``tensor`` or ``channel`` weight scales (``weight_scale`` of one
  value or one per output row), input activations none, or 8-bit float per ``token`` / ``tensor``.
  Modules named in ``ignore`` (exact names or ``re:`` patterns) stay unquantized.
- ``requested="fp8"`` (``--quantization fp8``) on a plain checkpoint: its weights are quantized at load,
  per output channel.

The loader (``loader.py``) then checks every tensor against the scheme: a float8 or integer tensor
in a checkpoint that declares no quantization is refused as well.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .defaults import QUANTIZATIONS
from .errors import ConfigError


SUPPORTED = ("fp8 (per-tensor weight scales; dynamic or static activations)",
             "compressed-tensors float-quantized FP8 (per-tensor or per-channel weight scales; "
             "dynamic per-token or static activations)",
             "--quantization fp8 on an unquantized checkpoint")
_WEIGHT_STRATEGIES = ("tensor", "channel")
_ACTIVATION_STRATEGIES = ("token", "tensor")


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """How a checkpoint's linear weights are quantized. ``method``: "fp8", "compressed-tensors", or
    "online-fp8" (quantized at load); ``ignore``: module names / ``re:`` patterns kept unquantized."""

    method: str
    ignore: tuple[str, ...] = ()
    static_activations: bool = False

    @property
    def in_checkpoint(self) -> bool:
        """Whether the checkpoint's tensors are already FP8 (else they are quantized at load)."""
        return self.method != "online-fp8"

    def quantizes(self, module: str) -> bool:
        """Whether the linear layer ``module`` (its checkpoint name, e.g. ``model.layers.0.mlp.up_proj``) is FP8."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module):
                    return False
            elif pattern == module or module.endswith("." + pattern):
                return False
        return True


def _refuse(what: str) -> ConfigError:
    return ConfigError(f"{what}; pdserve loads: {'; '.join(SUPPORTED)}")


def read_quantization(hf_config: dict, requested: str | None = None) -> QuantScheme | None:
    """The checkpoint's scheme (None: unquantized, no --quantization). ConfigError for anything else."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise ConfigError(f"unknown --quantization {requested!r}; supported: {', '.join(QUANTIZATIONS)}")
    qc = hf_config.get("quantization_config")
    if qc is None:
        qc = hf_config.get("compression_config")
    if qc is None:
        return QuantScheme("online-fp8") if requested == "fp8" else None
    if not isinstance(qc, dict):
        raise _refuse(f"config.json's quantization_config is not an object ({type(qc).__name__})")
    method = qc.get("quant_method")
    if method is None and "config_groups" in qc:
        method = "compressed-tensors"  # compression_config of older llm-compressor releases names no method
    if method == "fp8":
        scheme = _fp8_method(qc)
    elif method == "compressed-tensors":
        scheme = _compressed_tensors(qc)
    else:
        raise _refuse(f"unsupported quantization method {method!r} in config.json (quantization_config.quant_method)")
    if requested is not None and requested != "fp8":  # (unreachable today: one choice) kept for the next format
        raise ConfigError(f"--quantization {requested} asked for a checkpoint already quantized by {method}")
    return scheme


def _fp8_method(qc: dict) -> QuantScheme:
    if qc.get("weight_block_size") is not None:
        raise _refuse(f"unsupported fp8 scheme: block-wise weight scales (weight_block_size "
                      f"{qc['weight_block_size']})")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(f"unsupported fp8 format {fmt!r} (quantization_config.fmt); only e4m3")
    activation = qc.get("activation_scheme", "dynamic")
    if activation not in ("dynamic", "static"):
        raise _refuse(f"unsupported fp8 activation_scheme {activation!r}")
    ignore = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or []
    return QuantScheme("fp8", tuple(ignore), static_activations=activation == "static")


def _compressed_tensors(qc: dict) -> QuantScheme:
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":  # "frozen" / "calibration": weights not yet stored as FP8
        raise _refuse(f"unsupported compressed-tensors quantization_status {status!r}; only 'compressed' "
                      "(weights stored quantized)")
    sparsity = qc.get("sparsity_config")
    if sparsity:
        raise _refuse(f"unsupported compressed-tensors sparsity ({sparsity.get('format', sparsity)!r})")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse("compressed-tensors quantization_config has no config_groups")
    static = False
    for name, group in groups.items():
        fmt = (group or {}).get("format") or qc.get("format")
        if fmt != "float-quantized":
            raise _refuse(f"unsupported compressed-tensors format {fmt!r} (config group {name!r})")
        weights = group.get("weights") or {}
        _check_fp8_args(weights, f"{name}.weights", _WEIGHT_STRATEGIES)
        if weights.get("dynamic"):
            raise _refuse(f"unsupported compressed-tensors scheme: dynamic weight scales ({name}.weights)")
        acts = group.get("input_activations")
        if acts:
            _check_fp8_args(acts, f"{name}.input_activations", _ACTIVATION_STRATEGIES)
            static = static or not acts.get("dynamic", False)
        if group.get("output_activations"):
            raise _refuse(f"unsupported compressed-tensors scheme: output activations quantized ({name})")
    return QuantScheme("compressed-tensors", tuple(qc.get("ignore") or ()), static_activations=static)


def _check_fp8_args(args: dict, where: str, strategies: tuple[str, ...]) -> None:
    bits, kind, strategy = args.get("num_bits"), args.get("type"), args.get("strategy")
    if bits != 8 or kind != "float":
        raise _refuse(f"unsupported compressed-tensors scheme: {bits}-bit {kind} ({where}); only 8-bit float (FP8)")
    if strategy not in strategies:
        raise _refuse(f"unsupported compressed-tensors {where} strategy {strategy!r}; FP8 with "
                      f"{' or '.join(strategies)}")
    if args.get("symmetric") is False:
        raise _refuse(f"unsupported compressed-tensors scheme: asymmetric FP8 ({where})")
