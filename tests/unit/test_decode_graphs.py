"""DecodeGraphs on CPU: the body a CUDA graph captures, run eagerly over the static buffers, gives
the tokens of the ordinary step (greedy and seeded, batches padded up to their bucket), and the
padding rows touch no KV slot but the last real row's. Capture itself needs a GPU (tools/gpu/)."""

import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, blocks_needed
from pdserve.engine.decode_graphs import BUCKETS, DecodeGraphs, DecodeRow, buckets_up_to
from harness.engine_runs import run_all

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=10, temperature=0.8, top_k=40, seed=7, ignore_eos=True)


def test_buckets():
    assert buckets_up_to(1) == (1,)
    assert buckets_up_to(5) == (1, 2, 4, 5)
    assert buckets_up_to(32) == (1, 2, 4, 8, 16, 24, 32)
    assert buckets_up_to(1000)[-1] == BUCKETS[-1] == 256
    with pytest.raises(ValueError, match="max_batch"):
        buckets_up_to(0)


def _engine(tiny, max_len=96):
    return LLMEngine(tiny, EngineConfig(num_blocks=96, block_size=4, max_model_len=max_len, max_num_seqs=8))


def _with_graphs(tiny, max_batch=8):
    engine = _engine(tiny)
    graphs = DecodeGraphs(engine.model, engine.kv_cache, max_batch, blocks_needed(engine.max_model_len, 4))
    engine.runner.graphs = graphs
    buckets_run = []
    run = graphs.run
    graphs.run = lambda rows: (buckets_run.append(graphs.bucket_for(len(rows))), run(rows))[1]
    return engine, buckets_run


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_graph_body_gives_the_tokens_of_the_eager_step(tiny, sp):
    tok = tiny.tokenizer
    prompts = [tok.encode("Hello, world"), tok.encode("The quick brown fox jumps over the lazy dog."), tok.encode("x")]
    requests = {str(i): (p, sp) for i, p in enumerate(prompts)}
    eager = _engine(tiny)
    expected = run_all(eager, requests)
    engine, buckets_run = _with_graphs(tiny)
    assert run_all(engine, requests) == expected
    assert buckets_run and set(buckets_run) <= {1, 2, 4}, buckets_run
    assert 4 in buckets_run  # three rows padded to the bucket of four
    # the padding rows wrote only what the last real row wrote: the pools are the same
    assert torch.allclose(engine.kv_cache.tensor, eager.kv_cache.tensor, atol=1e-5)
    for e in (eager, engine):
        assert e.num_free_blocks() == e.num_blocks and e.num_requests() == 0


def test_rows_that_do_not_fit_run_eagerly(tiny):
    engine, _ = _with_graphs(tiny, max_batch=2)
    graphs = engine.runner.graphs
    row = DecodeRow(token=1, position=3, slot_row=0, block_table=[0])
    assert graphs.fits([row, row]) and not graphs.fits([row] * 3) and not graphs.fits([])
    assert not graphs.fits([DecodeRow(1, 3, 0, list(range(graphs.max_blocks + 1)))])
    tok = tiny.tokenizer
    requests = {str(i): (tok.encode(f"prompt number {i}"), GREEDY) for i in range(3)}
    assert run_all(engine, requests) == run_all(_engine(tiny), requests)  # 3 rows > 2: eager steps, same tokens


def test_capture_needs_cuda(tiny):
    engine, _ = _with_graphs(tiny)
    with pytest.raises(RuntimeError, match="CUDA"):
        engine.runner.graphs.capture()
