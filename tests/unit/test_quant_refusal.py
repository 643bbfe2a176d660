"""Quantized checkpoints are read from config.json and refused at start unless supported; never cast silently.

Each unsupported method or scheme gets one ConfigError naming it (and what pdserve loads); a plain
checkpoint holding FP8 or integer tensors without a quantization_config is refused naming the tensor.
"""

import json
import subprocess
import sys

import pytest
import torch

from pdserve.engine import ConfigError, ModelConfig, ModelLoadError, load_model
from pdserve.engine.checkpoint import random_hf_weights, save_hf_checkpoint
from pdserve.engine.quant_config import QuantScheme, read_quantization


def _fp8_group(weights_strategy="channel", acts=None, **weights):
    w = {"num_bits": 8, "type": "float", "strategy": weights_strategy, "symmetric": True, "dynamic": False}
    w.update(weights)
    if acts is None:
        acts = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
    return {"targets": ["Linear"], "weights": w, "input_activations": acts}


def _ct(group=None, **top):
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
          "config_groups": {"group_0": group or _fp8_group()}, "ignore": ["lm_head"]}
    qc.update(top)
    return {"quantization_config": qc}


REFUSED = [
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "unsupported quantization method 'awq'"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "unsupported quantization method 'gptq'"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "'bitsandbytes'"),
    ({"quantization_config": {"quant_method": "mxfp4"}}, "'mxfp4'"),
    ({"quantization_config": {"bits": 4}}, "unsupported quantization method None"),
    ({"quantization_config": "fp8"}, "is not an object"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     r"block-wise weight scales \(weight_block_size \[128, 128\]\)"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "smooth"}}, "activation_scheme 'smooth'"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "fp8 format 'e5m2'"),
    (_ct(format="pack-quantized"), "compressed-tensors format 'pack-quantized'"),
    (_ct(format="int-quantized"), "format 'int-quantized'"),
    (_ct(_fp8_group(num_bits=4, type="int")), r"4-bit int \(group_0.weights\)"),
    (_ct(_fp8_group("group", group_size=128)), "strategy 'group'"),
    (_ct(_fp8_group("block")), "strategy 'block'"),
    (_ct(_fp8_group(acts={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True})),
     r"8-bit int \(group_0.input_activations\)"),
    (_ct(_fp8_group(symmetric=False)), "asymmetric FP8"),
    (_ct(_fp8_group(dynamic=True)), "dynamic weight scales"),
    (_ct(quantization_status="frozen"), "quantization_status 'frozen'"),
    (_ct(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity \\('sparse-24-bitmask'\\)"),
    (_ct(config_groups={}), "has no config_groups"),
]


@pytest.mark.parametrize("config, message", REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_unsupported_quantization_is_refused_by_name(config, message):
    with pytest.raises(ConfigError, match=message) as err:
        read_quantization(config)
    assert "pdserve loads: fp8" in str(err.value)  # and says what is supported
    assert "\n" not in str(err.value)  # one line


def test_supported_schemes_are_read():
    assert read_quantization({}) is None
    assert read_quantization({}, "fp8") == QuantScheme("online-fp8")
    fp8 = read_quantization({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static",
                                                     "ignored_layers": ["lm_head"]}})
    assert fp8 == QuantScheme("fp8", ("lm_head",), static_activations=True) and fp8.in_checkpoint
    ct = read_quantization(_ct(_fp8_group("tensor", acts={"num_bits": 8, "type": "float", "strategy": "tensor",
                                                          "dynamic": False}), ignore=["lm_head", "re:.*mlp.gate$"]))
    assert ct.method == "compressed-tensors" and ct.static_activations
    assert not ct.quantizes("lm_head") and not ct.quantizes("model.layers.3.mlp.gate")
    assert ct.quantizes("model.layers.3.mlp.gate_proj") and ct.quantizes("model.layers.0.self_attn.q_proj")
    # older llm-compressor checkpoints: compression_config, no quant_method
    legacy = {"compression_config": {k: v for k, v in _ct()["quantization_config"].items() if k != "quant_method"}}
    assert read_quantization(legacy).method == "compressed-tensors"
    with pytest.raises(ConfigError, match="unknown --quantization 'int4'"):
        read_quantization({}, "int4")


def _checkpoint(tmp_path, mutate_weights=None, extra_config=None):
    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2, num_kv_heads=1)
    w = random_hf_weights(cfg)
    if mutate_weights:
        mutate_weights(w)
    d = save_hf_checkpoint(w, cfg, tmp_path / "ckpt")
    if extra_config:
        hf = json.loads((d / "config.json").read_text())
        hf.update(extra_config)
        (d / "config.json").write_text(json.dumps(hf))
    return d


def test_awq_checkpoint_is_refused_at_load(tmp_path):
    d = _checkpoint(tmp_path, extra_config={"quantization_config": {"quant_method": "awq", "bits": 4}})
    with pytest.raises(ConfigError, match="unsupported quantization method 'awq'"):
        load_model(str(d))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8, torch.uint8])
def test_undeclared_quantized_tensor_is_never_cast(tmp_path, dtype):
    def to_quantized(w):
        w["model.layers.0.mlp.up_proj.weight"] = w["model.layers.0.mlp.up_proj.weight"].to(dtype)

    d = _checkpoint(tmp_path, to_quantized)
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(ModelLoadError, match=f"'model.layers.0.mlp.up_proj.weight' is {name} but config.json "
                                             "declares no quantization"):
        load_model(str(d))


def test_server_start_names_the_method_in_one_line(tmp_path):
    d = _checkpoint(tmp_path, extra_config={"quantization_config": {"quant_method": "gptq", "bits": 4}})
    done = subprocess.run([sys.executable, "-m", "pdserve", "prefill", "--model", str(d), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("pdserve: cannot start the engine: unsupported quantization method 'gptq'"), done.stderr


def _fp8_checkpoint(tmp_path, fmt="ct-channel"):
    from harness.fp8_checkpoints import quantize_checkpoint

    return quantize_checkpoint(_checkpoint(tmp_path), tmp_path / fmt, fmt)


def _rewrite(directory, change):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(directory / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"))


def test_fp8_checkpoint_without_a_scale_is_refused_naming_it(tmp_path):
    d = _fp8_checkpoint(tmp_path)
    _rewrite(d, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight_scale"))
    with pytest.raises(ModelLoadError, match="'model.layers.0.self_attn.k_proj.weight_scale' is missing"):
        load_model(str(d))


def test_fp8_scale_of_another_shape_is_refused_naming_it(tmp_path):
    d = _fp8_checkpoint(tmp_path)

    def blockwise(t):
        t["model.layers.0.mlp.down_proj.weight_scale"] = torch.ones(1, 1, 2)

    _rewrite(d, blockwise)
    with pytest.raises(ModelLoadError, match=r"down_proj.weight_scale has shape \(1, 1, 2\): expected one value"):
        load_model(str(d))


def test_int8_tensor_in_an_fp8_checkpoint_is_refused(tmp_path):
    d = _fp8_checkpoint(tmp_path, "fp8")

    def int8(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"].view(torch.int8)

    _rewrite(d, int8)
    with pytest.raises(ModelLoadError, match="'model.layers.0.mlp.up_proj.weight' is int8, not float8_e4m3fn, "
                                             "in a checkpoint quantized by fp8"):
        load_model(str(d))
