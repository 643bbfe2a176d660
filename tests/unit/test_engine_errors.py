"""Bad input gets a clear error naming the problem, and leaves every KV block free."""

import json

import pytest
import torch

from pdserve.engine import (
    ConfigError,
    EngineConfig,
    LLMEngine,
    ModelConfig,
    ModelLoadError,
    OutOfBlocksError,
    PromptTooLongError,
    SamplingParams,
    load_model,
)
from pdserve.engine.checkpoint import random_hf_weights, save_hf_checkpoint
from harness.engine_runs import run_all

SP = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("builtin:tiny")


def _small_cfg(**kw):
    return ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2, num_kv_heads=1,
                       **kw)


def _checkpoint(tmp_path, cfg=None, num_shards=1, mutate=None):
    cfg = cfg or _small_cfg()
    w = random_hf_weights(cfg)
    if mutate:
        mutate(w)
    return save_hf_checkpoint(w, cfg, tmp_path / "ckpt", num_shards=num_shards)


def _assert_idle(engine):
    assert engine.num_free_blocks() == engine.num_blocks
    assert engine.num_requests() == 0 and not engine.has_unfinished()


def test_unknown_architecture_is_named(tmp_path):
    d = _checkpoint(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported architecture 'GPTNeoXForCausalLM'"):
        load_model(str(d))


def test_unknown_rope_scaling_type_is_named():
    with pytest.raises(ConfigError, match="unsupported rope_scaling type 'yarn'"):
        _small_cfg(rope_scaling={"rope_type": "yarn", "factor": 4.0})


def test_missing_config_field_is_named(tmp_path):
    d = _checkpoint(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="missing the field 'hidden_size'"):
        load_model(str(d))


@pytest.mark.parametrize("shards", [1, 2])
def test_missing_weight_is_named(tmp_path, shards):
    d = _checkpoint(tmp_path, num_shards=shards, mutate=lambda w: w.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match="'model.layers.0.mlp.up_proj.weight' is missing"):
        load_model(str(d))


def test_misshaped_weight_is_named(tmp_path):
    def shrink(w):
        w["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(4, 16)

    d = _checkpoint(tmp_path, num_shards=2, mutate=shrink)
    with pytest.raises(ModelLoadError,
                       match=r"'model.layers.0.self_attn.k_proj.weight' has shape \(4, 16\), expected \(8, 16\)"):
        load_model(str(d))


def test_missing_shard_and_no_weights(tmp_path):
    d = _checkpoint(tmp_path, num_shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="shard 'model-00002-of-00002.safetensors'"):
        load_model(str(d))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(_small_cfg().to_hf_dict()))
    with pytest.raises(ModelLoadError, match="no .safetensors weights"):
        load_model(str(empty))
    with pytest.raises(ModelLoadError, match="neither a built-in model"):
        load_model(str(tmp_path / "nowhere"))


def test_prompt_too_long_names_the_lengths(tiny):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=64, block_size=16, max_model_len=100))
    long_prompt = [65] * 100
    with pytest.raises(PromptTooLongError, match="prompt has 100 tokens but the maximum context length is 100"):
        engine.add_request("a", long_prompt, SP)
    with pytest.raises(PromptTooLongError):
        engine.pd.prefill_only("b", long_prompt, SP)
    with pytest.raises(PromptTooLongError):
        engine.pd.reserve("c", 100, 8)
    with pytest.raises(ValueError, match="exceeds the model's context length 2048"):
        LLMEngine(tiny, EngineConfig(num_blocks=4, max_model_len=4096))
    _assert_idle(engine)


def test_bad_prompt_and_request_ids(tiny):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=16, block_size=16))
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request("a", [], SP)
    with pytest.raises(ValueError, match=r"token id 999 is outside the vocabulary \[0, 258\)"):
        engine.add_request("a", [1, 999], SP)
    engine.add_request("a", [1, 2], SP)
    with pytest.raises(ValueError, match="'a' is already in use"):
        engine.add_request("a", [1, 2], SP)
    with pytest.raises(ValueError, match="has no reservation"):
        engine.pd.add_prefilled("zzz", [1, 2], 3, SP)
    assert engine.abort("a") and not engine.abort("a")
    _assert_idle(engine)


def test_request_that_can_never_fit_is_refused(tiny):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=4, block_size=16))
    with pytest.raises(OutOfBlocksError, match="needs 5 KV blocks .* the pool has only 4"):
        engine.add_request("big", [65] * 70, SP)
    _assert_idle(engine)


def test_out_of_blocks_request_waits_and_others_are_unaffected(tiny):
    tok = tiny.tokenizer
    a, b = tok.encode("first request " * 3), tok.encode("second one " * 3)
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    alone = run_all(LLMEngine(tiny, EngineConfig(num_blocks=64, block_size=8)), {"a": (a, sp), "b": (b, sp)})
    # 12 blocks of 8: one request at full length takes 8 (prompt 43 + 20 tokens), so b waits for a
    engine = LLMEngine(tiny, EngineConfig(num_blocks=12, block_size=8, enable_prefix_cache=False))
    engine.add_request("a", a, sp)
    engine.step()
    held = engine.block_manager.allocate([0], 8 * 3)[0]  # someone else holds 3 blocks
    engine.add_request("b", b, sp)
    got = {"a": alone["a"][:1], "b": []}
    events = []
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
            events.append((o.request_id, o.finished))
    # b waited for a's blocks: its first output comes after a finished; a was never preempted
    assert events.index(("a", True)) < events.index(("b", False))
    assert engine.num_preemptions == 0
    assert got == alone
    engine.block_manager.free(held)
    _assert_idle(engine)


def test_reserve_refuses_with_reason_and_changes_nothing(tiny):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=8, block_size=16))
    ids = engine.pd.reserve("a", 50, 14)  # 64 tokens -> 4 blocks
    assert len(ids) == 4
    with pytest.raises(OutOfBlocksError, match="need 5 free KV blocks .* only 4 are free") as err:
        engine.pd.reserve("b", 60, 20)
    assert "only 4 are free" in err.value.reason
    assert engine.num_free_blocks() == 4
    assert engine.abort("a")
    _assert_idle(engine)


def test_prefill_only_out_of_blocks_frees_nothing_it_did_not_take(tiny):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=2, block_size=16))
    held = engine.pd.reserve("other", 20, 4)
    with pytest.raises(OutOfBlocksError):
        engine.pd.prefill_only("p", [65] * 20, SP)
    assert engine.num_free_blocks() == 0 and engine.num_requests() == 1
    engine.abort("other")
    assert held and engine.num_free_blocks() == 2


def test_failing_callback_frees_blocks(tiny):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=8, block_size=16))

    def boom(layer, blocks, first):
        if layer == 2:
            raise ConnectionError("peer went away")

    with pytest.raises(ConnectionError):
        engine.pd.prefill_only("p", [65] * 40, SP, on_layer=boom)
    _assert_idle(engine)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-1), "temperature must be >= 0, got -1"),
        (dict(temperature=float("nan")), "temperature must be >= 0"),
        (dict(top_p=0), r"top_p must be in \(0, 1\], got 0"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        (dict(top_k=-2), "top_k must be -1, 0"),
        (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
        (dict(max_tokens=2.5), "max_tokens must be an integer"),
        (dict(seed="x"), "seed must be an integer"),
        (dict(stop=[""]), "stop must be a list of non-empty strings"),
        (dict(stop_token_ids=[-1]), "stop_token_ids must be a list of non-negative integers"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_engine_config():
    with pytest.raises(ValueError, match="block_size must be positive"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="num_blocks must be positive"):
        EngineConfig(num_blocks=-3)


def test_prefill_many_is_all_or_nothing(tiny):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=3, block_size=16))
    with pytest.raises(OutOfBlocksError):
        engine.pd.prefill_many([("a", [65] * 20, SP), ("b", [66] * 20, SP)])  # 2 + 2 blocks > 3
    _assert_idle(engine)
    with pytest.raises(ValueError, match="appears twice"):
        engine.pd.prefill_many([("a", [65] * 5, SP), ("a", [66] * 5, SP)])
    _assert_idle(engine)
    with pytest.raises(PromptTooLongError):
        engine.pd.prefill_many([("a", [65] * 5, SP), ("b", [66] * 5000, SP)])
    _assert_idle(engine)
