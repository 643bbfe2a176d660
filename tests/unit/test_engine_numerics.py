"""Our decoder against transformers on the same weights (written by the test as safetensors).

Logits over a batch of prompts of different lengths (prefill rows and decode steps) within
1e-4 in float32; greedy 32 tokens identical to transformers' generate.
"""

import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine, ModelConfig, SamplingParams, load_model
from pdserve.engine.checkpoint import random_hf_weights, save_hf_checkpoint
from harness.engine_runs import record_step_logits, run_all

transformers = pytest.importorskip("transformers")

TOL = 1e-4
CASES = {
    # GQA, untied embeddings, llama3 rope scaling, sharded checkpoint with an index
    "llama-gqa-llama3rope-sharded": (
        dict(
            architecture="LlamaForCausalLM",
            num_heads=4,
            num_kv_heads=2,
            rope_theta=500.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        3,
    ),
    # q/k/v bias, tied embeddings, single file
    "qwen2-bias-tied": (
        dict(architecture="Qwen2ForCausalLM", num_heads=4, num_kv_heads=1, attention_bias=True,
             tie_word_embeddings=True),
        1,
    ),
    # multi-head attention, linear rope scaling
    "llama-mha-linearrope": (
        dict(architecture="LlamaForCausalLM", num_heads=2, num_kv_heads=2,
             rope_scaling={"type": "linear", "factor": 2.0}),
        1,
    ),
}
PROMPT_LENS = [5, 19, 40]


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    torch.set_num_threads(1)
    extra, shards = CASES[request.param]
    cfg = ModelConfig(
        vocab_size=96, hidden_size=64, intermediate_size=112, num_layers=2, max_position_embeddings=256, **extra
    )
    d = tmp_path_factory.mktemp(request.param)
    save_hf_checkpoint(random_hf_weights(cfg, seed=3, std=0.15), cfg, d, num_shards=shards)
    if shards > 1:
        assert (d / "model.safetensors.index.json").exists()
    ours = load_model(str(d))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    assert type(hf).__name__ == extra["architecture"]
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return ours, hf, prompts


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_prefill_logits_match_transformers(pair):
    ours, hf, prompts = pair
    engine = LLMEngine(ours, EngineConfig(num_blocks=32, block_size=8))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=1, temperature=0))
    seqs = engine.scheduler.schedule_prefills()
    assert len(seqs) == len(prompts)  # one forward over the whole batch
    batch = engine.runner.build_batch(seqs, [])
    batch.logits_rows = torch.arange(batch.input_ids.shape[0])  # every position, not just the last
    logits = ours.model(batch, engine.kv_cache)
    for span, p in zip(batch.prefills, prompts):
        diff = (logits[span.start : span.end] - _hf_logits(hf, p)).abs().max().item()
        assert diff <= TOL, f"prompt of {len(p)} tokens: max abs diff {diff}"


def test_decode_logits_match_transformers(pair):
    ours, hf, prompts = pair
    engine = LLMEngine(ours, EngineConfig(num_blocks=32, block_size=8))
    seen = record_step_logits(engine)  # logits per step, rows in request order
    out = run_all(engine, {str(i): (p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)) for i,
                           p in enumerate(prompts)})
    assert len(seen) == 6 and all(s.shape[0] == len(prompts) for s in seen)
    for i, p in enumerate(prompts):
        full = p + out[str(i)]
        ref = _hf_logits(hf, full)
        for step, logits in enumerate(seen):
            diff = (logits[i] - ref[len(p) - 1 + step]).abs().max().item()
            assert diff <= TOL, f"prompt {i} step {step}: max abs diff {diff}"


def test_greedy_32_tokens_identical_to_transformers_generate(pair):
    ours, hf, prompts = pair
    engine = LLMEngine(ours, EngineConfig(num_blocks=32, block_size=8))
    sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    got = run_all(engine, {str(i): (p, sp) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert got[str(i)] == ref[0, len(p) :].tolist(), f"prompt {i}"
    assert engine.num_free_blocks() == engine.num_blocks
