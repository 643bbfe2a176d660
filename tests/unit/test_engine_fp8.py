"""FP8 checkpoints serve the model their own dequantized weights define, on every family.

Per family (Llama, Qwen2 with q/k/v biases, Qwen3, Qwen3-MoE with FP8 experts, Gemma 2, Gemma 3) and per
published layout (compressed-tensors per-channel and per-tensor, the ``fp8`` method; written by
``harness/fp8_checkpoints.py``), the engine on the FP8 checkpoint against the engine on its dequantized
float32 reference: on the CPU path (weights read in place or widened exactly) the first step's logits
within ``CPU_TOL`` and 12 greedy tokens identical. The FP8 tensor-core path (``fp8.scaled_mm_linear``,
activations quantized per token; torch runs it on the CPU too) is checked against the same arithmetic
written in plain torch (logits within ``W8A8_TOL`` of their spread, tokens equal): its distance from the
dequantized model depends on the model, and is measured on a GPU by the GPU check.
``--quantization fp8`` quantizes a plain checkpoint per channel at load with the same results as its
per-channel checkpoint. Nothing is held after each run.
"""

import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine, ModelConfig, load_model
from pdserve.engine import fp8
from pdserve.engine.checkpoint import random_hf_weights, save_hf_checkpoint
from harness.engine_runs import greedy_with_first_logits
from harness.fp8_checkpoints import FORMATS, quantize_checkpoint
from harness.hf_checkpoints import FAMILIES, build_tiny

CPU_TOL = 2e-4  # float32: the kernel sums in another order than the reference's GEMM
W8A8_TOL = 0.02  # _scaled_mm against the same rounding in torch: max |logit error| / std of the logits
N_TOKENS = 12
PROMPTS = [[5, 17, 33, 2, 9, 41, 7, 3, 60, 11], [8, 1, 22, 19, 4, 50, 13, 27, 6, 30, 2, 44, 15, 37, 9, 21, 3, 5]]


def _plain(family: str, directory):
    if family in ("llama", "qwen2"):
        cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=112, num_layers=3, num_heads=4,
                          num_kv_heads=2, attention_bias=family == "qwen2",
                          architecture="LlamaForCausalLM" if family == "llama" else "Qwen2ForCausalLM")
        return save_hf_checkpoint(random_hf_weights(cfg, seed=3, std=0.15), cfg, directory)
    build_tiny(family, seed=3).save_pretrained(str(directory))
    return directory


def _run(model_dir, **load):
    loaded = load_model(str(model_dir), **load)
    engine = LLMEngine(loaded, EngineConfig(num_blocks=32, block_size=8))
    tokens, logits = greedy_with_first_logits(engine, PROMPTS, N_TOKENS)
    assert engine.num_free_blocks() == engine.num_blocks and engine.num_requests() == 0
    return loaded, tokens, logits


@pytest.fixture(scope="module", params=["llama", "qwen2", *FAMILIES])
def family_dirs(request, tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp(request.param)
    plain = _plain(request.param, root / "plain")
    return request.param, plain, root


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_checkpoint_matches_its_dequantized_weights(family_dirs, fmt):
    family, plain, root = family_dirs
    quantized = quantize_checkpoint(plain, root / fmt, fmt, reference=root / f"{fmt}-ref")
    loaded, tokens, logits = _run(quantized)
    _, ref_tokens, ref_logits = _run(root / f"{fmt}-ref")
    layer = loaded.model.layers[0]
    assert layer.q_proj.weight.dtype == fp8.FP8 and layer.o_proj.weight.dtype == fp8.FP8
    assert family == "qwen3_moe" or layer.down_proj.weight.dtype == fp8.FP8
    assert loaded.model.lm_head.weight.dtype == torch.float32  # the LM head stays plain
    if family == "qwen3_moe":  # layer 0 is sparse: its experts are FP8, its router plain
        assert layer.experts_gate_up.dtype == fp8.FP8 and layer.experts_down_scale.dtype == torch.float32
        assert layer.router.weight.dtype == torch.float32
    assert (logits - ref_logits).abs().max().item() < CPU_TOL
    assert tokens == ref_tokens


def _fake_w8a8(x, w, scale, bias=None):
    """The tensor-core path's arithmetic in plain float32 torch: each row of x rounded to FP8 with its own
    scale, times the widened weights."""
    rows = x.reshape(-1, x.shape[-1]).float()
    x_scale = (rows.abs().amax(dim=-1, keepdim=True) / fp8.FP8_MAX).clamp(min=1e-12)
    xq = (rows / x_scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8).float() * x_scale
    out = xq @ fp8.dequantize(w, scale, torch.float32).t()
    if bias is not None:
        out = out + bias.to(torch.bfloat16).float()
    return out.to(torch.bfloat16).to(x.dtype).view(*x.shape[:-1], w.shape[0])


def test_fp8_tensor_core_path_computes_w8a8(family_dirs, monkeypatch):
    """What an Ada/Hopper GPU runs (FP8 x FP8 with per-token activation scales, bf16 out), here through
    torch's CPU implementation of ``_scaled_mm``, against the same arithmetic in plain torch."""
    family, plain, root = family_dirs
    quantized = quantize_checkpoint(plain, root / "w8a8", "ct-channel")
    calls = {"scaled_mm": 0, "fake": 0}

    def counted(name, fn):
        def run(x, w, s, b=None):
            calls[name] += 1
            return fn(x, w, s, b)
        return run

    # the FP8 matmul the model's ops take from fp8.linear_for when they are chosen (layer_ops.choose)
    monkeypatch.setattr(fp8, "linear_for", lambda device: counted("scaled_mm", fp8.scaled_mm_linear))
    _, tokens, logits = _run(quantized)
    monkeypatch.setattr(fp8, "linear_for", lambda device: counted("fake", _fake_w8a8))
    _, ref_tokens, ref_logits = _run(quantized)
    assert calls["scaled_mm"] > 0 and calls["fake"] > 0  # each run's FP8 matmuls went where it was told
    assert (logits - ref_logits).abs().max().item() / ref_logits.std().item() < W8A8_TOL
    assert tokens == ref_tokens


def test_online_fp8_equals_the_per_channel_checkpoint(family_dirs):
    family, plain, root = family_dirs
    quantize_checkpoint(plain, root / "online-ct", "ct-channel")
    online, tokens, logits = _run(plain, quantization="fp8")
    assert online.quantization.method == "online-fp8"
    assert online.model.layers[0].o_proj.weight.dtype == fp8.FP8
    _, ct_tokens, ct_logits = _run(root / "online-ct")
    assert tokens == ct_tokens
    assert (logits - ct_logits).abs().max().item() < CPU_TOL


def test_builtin_model_quantized_at_load_in_bfloat16():
    ref = load_model("tiny", dtype=torch.bfloat16)
    q = load_model("tiny", dtype=torch.bfloat16, quantization="fp8")
    ids = torch.tensor([[72, 101, 108, 108, 111]])
    assert q.model.layers[1].gate_proj.weight.dtype == fp8.FP8
    fp8_bytes = sum(p.numel() for p in q.model.parameters() if p.dtype == fp8.FP8)
    plain_bytes = sum(2 * p.numel() for n, p in ref.model.named_parameters() if n.endswith("proj.weight"))
    assert 2 * fp8_bytes == plain_bytes  # the projections hold half the bytes of bf16
    for layer, plain in zip(q.model.layers, ref.model.layers):  # FP8 times scales: bf16's within FP8's rounding
        w, s, orig = layer.up_proj.weight, layer.up_proj.weight_scale, plain.up_proj.weight.float()
        err = (fp8.dequantize(w, s, torch.float32) - orig).abs()
        assert (err <= orig.abs() / 16 + s[:, None] * 2**-9).all()  # half an FP8 step (3 mantissa bits)
    # and the engine serves it: greedy text of the quantized model, nothing held after
    engine = LLMEngine(q, EngineConfig(num_blocks=16, block_size=8))
    tokens, _ = greedy_with_first_logits(engine, [ids[0].tolist()], 8)
    assert len(tokens[0]) == 8 and engine.num_free_blocks() == engine.num_blocks


@pytest.mark.parametrize("reuse", [False, True])
def test_fp8_weights_with_fp8_kv_pd_equals_the_engine_alone(family_dirs, reuse):
    """Both halves of issue 45 at once: an FP8 checkpoint served with an FP8 KV cache, prefill and decode
    apart in one process (KV copied layer by layer, with decode prefix reuse or without), equals the same
    engine alone; every block back after."""
    from pdserve.engine import SamplingParams
    from harness.engine_runs import run_all, run_pd

    family, plain, root = family_dirs
    ckpt = quantize_checkpoint(plain, root / f"both-{reuse}", "ct-channel")
    loaded = load_model(str(ckpt))
    make = lambda: LLMEngine(loaded, EngineConfig(num_blocks=32, block_size=8, kv_cache_dtype="fp8"))  # noqa: E731
    sp = SamplingParams(max_tokens=N_TOKENS, temperature=0, ignore_eos=True)
    requests = {f"r{i}": (p, sp) for i, p in enumerate(PROMPTS)}
    alone = run_all(make(), requests)
    prefill, decode = make(), make()
    if reuse:  # the decode holds the first prompt's blocks: the second run moves only what it lacks
        run_all(decode, {"warm": (PROMPTS[0], sp)})
    assert run_pd(prefill, decode, requests, reuse=reuse) == alone
    for engine in (prefill, decode):
        assert engine.num_requests() == 0
    assert prefill.num_free_blocks() == prefill.num_blocks
