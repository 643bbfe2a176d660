"""Only the sampled rows leave a prefill's last layer (model.py ``run_layers(out_rows=...)``, the torch and native
backends' ``attend_rows``): the logits a step samples equal those of the dense reference at the prompt's last
position (float32, 1e-5), for a prompt computed at once, in chunks (each chunk's attention over the cache), after
a prefix-cache hit and beside decode rows; a chunk before a prompt's last computes no last-layer rows at all; every
layer's K/V is written as before."""

import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from harness.engine_runs import record_step_logits, run_all

TOL = 1e-5
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _prompt(tiny, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, tiny.config.vocab_size, (n,), generator=g).tolist()


def _engine(tiny, budget=2048, chunk=0, native=True):
    return LLMEngine(tiny, EngineConfig(num_blocks=128, block_size=4, max_num_batched_tokens=budget,
                                        long_prefill_threshold=chunk, native_kernels=native))


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("budget", [2048, 16], ids=["whole", "chunks-of-16"])
def test_the_sampled_row_equals_the_dense_last_position(tiny, budget, native):
    prompt = _prompt(tiny, 61, 1)
    engine = _engine(tiny, budget, native=native)
    seen = record_step_logits(engine, limit=1)
    got = run_all(engine, {"r": (prompt, GREEDY)})["r"]
    dense = tiny.model.forward_dense(torch.tensor(prompt))[-1]
    assert (seen[0][0] - dense).abs().max().item() <= TOL
    assert got == run_all(_engine(tiny), {"r": (prompt, GREEDY)})["r"]
    assert engine.num_free_blocks() == engine.num_blocks


def test_after_a_prefix_hit_and_beside_decode_rows(tiny):
    base = _prompt(tiny, 40, 2)
    engine = _engine(tiny)
    run_all(engine, {"first": (base, GREEDY)})  # its full blocks stay in the prefix cache
    seen = record_step_logits(engine)
    later = base + _prompt(tiny, 13, 3)
    engine.add_request("decoding", _prompt(tiny, 9, 4), GREEDY)
    engine.step()  # its prefill; it is at a decode row from here on
    engine.add_request("hit", later, GREEDY)
    engine.step()  # the hit's prefill (40 cached tokens) beside the decode row
    assert engine.scheduler.seqs["hit"].num_cached_tokens == 40
    rows = seen[-1]
    assert rows.shape[0] == 2  # the hit's sampled row, then the decode row
    assert (rows[0] - tiny.model.forward_dense(torch.tensor(later))[-1]).abs().max().item() <= TOL
    decoding = engine.scheduler.seqs["decoding"]
    context = decoding.prompt_ids + decoding.output_ids[:1]  # what its row of that step attended to
    assert (rows[1] - tiny.model.forward_dense(torch.tensor(context))[-1]).abs().max().item() <= TOL
    while engine.has_unfinished():
        engine.step()
    assert engine.num_free_blocks() == engine.num_blocks


def test_a_chunk_before_the_last_runs_no_last_layer_rows_and_writes_every_layer(tiny):
    prompt = _prompt(tiny, 40, 5)
    whole, chunked = _engine(tiny), _engine(tiny, budget=16)
    last = tiny.model.layers[-1]
    rows_in = []
    real_finish = last.finish
    last.finish = lambda x, attn: (rows_in.append(x.shape[0]), real_finish(x, attn))[1]
    try:
        assert chunked.pd.prefill_only("r", prompt, GREEDY) == whole.pd.prefill_only("r", prompt, GREEDY)
    finally:
        del last.finish
    assert rows_in == [1, 1]  # whole: its one sampled row; chunked: chunks of 16, 16 skip the last layer, 8 samples
    for layer in range(tiny.config.num_layers):
        got = chunked.kv_cache.layer(layer)[chunked.pd.prefill_block_ids("r")]
        want = whole.kv_cache.layer(layer)[whole.pd.prefill_block_ids("r")]
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    for e in (whole, chunked):
        e.pd.release("r")
        assert e.num_free_blocks() == e.num_blocks and e.num_requests() == 0
