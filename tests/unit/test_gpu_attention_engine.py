"""The engine with its attention on the paged Triton kernels (the CUDA path), run here on CPU under
Triton's interpreter: the same greedy tokens as attention.py for mixed prefill/decode batches, prefix
hits (a prefill over cached blocks), a prompt longer than the sliding window, Gemma 2's soft-capping,
and decode steps from the static buffers that a CUDA graph captures. Pools and requests back to empty."""

import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, blocks_needed, load_model
from pdserve.engine.decode_graphs import DecodeGraphs
from harness.engine_runs import run_all
from harness.hf_checkpoints import build_tiny

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
BS = 16  # the kernels take power-of-two blocks >= 16


def _engine(loaded, attention):
    engine = LLMEngine(loaded, EngineConfig(num_blocks=24, block_size=BS, max_num_seqs=4, max_model_len=128))
    assert engine.runner.attention in ("native", "torch")  # CPU: the kernels only where usable (CUDA)
    engine.runner.attention = attention
    return engine


def _requests(loaded, shared_prefix=True):
    gen = torch.Generator().manual_seed(5)
    vocab = loaded.config.vocab_size
    base = torch.randint(0, vocab, (40,), generator=gen).tolist()
    prompts = [base, base[:35] + [1, 2, 3], torch.randint(0, vocab, (7,), generator=gen).tolist()]
    return {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts)}


def _same_tokens(loaded):
    requests = _requests(loaded)
    expected = run_all(_engine(loaded, "torch"), requests)
    engine = _engine(loaded, "triton")
    assert run_all(engine, requests) == expected
    again = run_all(engine, {"hit": requests["r1"]})  # r1's first two blocks are cached now: a prefix hit
    assert again["hit"] == expected["r1"] and engine.prefix_hit_tokens() > 0
    assert engine.num_free_blocks() == engine.num_blocks and engine.num_requests() == 0


def test_kernels_give_the_tokens_of_attention_py(tiny, monkeypatch):
    from pdserve.engine import gpu_attention

    calls = {"paged_prefill": 0, "paged_decode": 0}
    for name in calls:
        real = getattr(gpu_attention, name)
        monkeypatch.setattr(gpu_attention, name,
                            lambda *a, _n=name, _f=real, **kw: (calls.__setitem__(_n, calls[_n] + 1), _f(*a, **kw))[1])
    _same_tokens(tiny)
    assert calls["paged_prefill"] > 0 and calls["paged_decode"] > 0, calls


def test_kernels_with_window_and_softcap(tmp_path):
    """Gemma 2: sliding window 12 (< the prompts), attention logit soft-capping, query_pre_attn_scalar."""
    hf = build_tiny("gemma2", seed=3)
    hf.save_pretrained(str(tmp_path))
    loaded = load_model(str(tmp_path))
    assert loaded.config.attn_logit_softcapping and loaded.config.sliding_window
    _same_tokens(loaded)


def test_graph_body_on_the_kernels(tiny):
    requests = _requests(tiny)
    expected = run_all(_engine(tiny, "torch"), requests)
    engine = _engine(tiny, "triton")
    graphs = DecodeGraphs(engine.model, engine.kv_cache, 4, blocks_needed(engine.max_model_len, BS), attention="triton")
    engine.runner.graphs = graphs
    used = []
    run = graphs.run
    graphs.run = lambda rows: (used.append(len(rows)), run(rows))[1]
    assert run_all(engine, requests) == expected
    assert used, "no decode step ran from the graph buffers"
    assert engine.num_free_blocks() == engine.num_blocks and engine.num_requests() == 0


def test_the_runner_keeps_attention_py_where_the_kernels_do_not_apply(tiny):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=24, block_size=8))
    assert engine.runner.attention in ("native", "torch") and engine.runner.graphs is None
    with pytest.raises(ValueError, match="block_size 8"):
        from pdserve.engine import gpu_attention

        kv = engine.kv_cache
        gpu_attention.paged_decode(torch.zeros(1, tiny.config.num_heads, kv.head_dim), kv.layer(0),
                                   torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                                   torch.ones(1, dtype=torch.long), None)
