"""Ways of computing the same thing give the same tokens: paged vs unpaged, batched vs alone,
prefix-cache hit vs miss, layer-by-layer vs fused, P/D (KV copied between two pools) vs colocated,
preempted vs not."""

import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from harness.engine_runs import run_all, run_pd

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)


def _prompts(tiny):
    tok = tiny.tokenizer
    return [tok.encode("Hello, world"), tok.encode("The quick brown fox jumps over the lazy dog. " * 2),
            tok.encode("x")]


def _engine(tiny, **kw):
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", 4)
    return LLMEngine(tiny, EngineConfig(**kw))


def _dense_greedy(tiny, ids, n):
    ids = list(ids)
    for _ in range(n):
        ids.append(int(tiny.model.forward_dense(torch.tensor(ids))[-1].argmax()))
    return ids[-n:]


def test_paged_equals_unpaged(tiny):
    engine = _engine(tiny)
    # scatter the free list so block tables are not contiguous runs
    held = [engine.block_manager.allocate([i], 1)[0] for i in range(20)]
    for t in held[::2]:
        engine.block_manager.free(t)
    prompts = _prompts(tiny)
    got = run_all(engine, {str(i): (p, GREEDY) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        assert got[str(i)] == _dense_greedy(tiny, p, GREEDY.max_tokens)
    for t in held[1::2]:
        engine.block_manager.free(t)
    assert engine.num_free_blocks() == engine.num_blocks


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_batched_equals_alone(tiny, sp):
    prompts = _prompts(tiny)
    together = run_all(_engine(tiny), {str(i): (p, sp) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        alone = run_all(_engine(tiny), {"a": (p, sp)})
        assert together[str(i)] == alone["a"]


def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny):
    p = _prompts(tiny)[0]
    a = run_all(_engine(tiny), {"a": (p, SEEDED)})["a"]
    b = run_all(_engine(tiny), {"a": (p, SEEDED)})["a"]
    other = SamplingParams(**{**{f: getattr(SEEDED, f) for f in SEEDED.__slots__}, "seed": 99})
    c = run_all(_engine(tiny), {"a": (p, other)})["a"]
    assert a == b and a != c


def test_prefix_cache_hit_equals_miss(tiny):
    tok = tiny.tokenizer
    system = "You are a helpful assistant. Answer briefly and precisely. "
    first, second = tok.encode(system + "What is 2+2?"), tok.encode(system + "Name a colour.")
    engine = _engine(tiny)
    run_all(engine, {"warm": (first, GREEDY)})
    engine.add_request("hit", second, GREEDY)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    hit_tokens = [t for o in outs for t in o.new_token_ids]
    assert outs[0].num_cached_tokens >= 48  # most of the shared system prompt came from the cache
    miss = run_all(_engine(tiny, enable_prefix_cache=False), {"miss": (second, GREEDY)})["miss"]
    assert hit_tokens == miss
    assert engine.num_free_blocks() == engine.num_blocks


def test_layer_by_layer_equals_fused_and_kv_is_written_before_callback(tiny):
    p = _prompts(tiny)[1]
    fused = _engine(tiny)
    first_fused = fused.pd.prefill_only("r", p, GREEDY)
    blocks_fused = fused.pd.prefill_block_ids("r")

    layered = _engine(tiny)
    seen, marks = [], []
    mark = layered.kv_cache.mark_written
    layered.kv_cache.mark_written = lambda layer: (marks.append(layer), mark(layer))

    def on_layer(layer, block_ids, first):
        assert first == 0  # one chunk (the prompt is shorter than the engine's per-prompt chunk)
        kv = layered.kv_cache
        # the layer's writes were marked before the callback (on a GPU: the event the CacheStore's thread
        # waits on); on CPU they are done already, so there is nothing to wait for
        assert marks[-1] == layer and kv.written_waiter(layer) is None
        # this layer's KV is final already; the next layer's is not written yet
        assert torch.equal(kv.layer(layer)[block_ids], fused.kv_cache.layer(layer)[blocks_fused])
        if layer + 1 < kv.num_layers:
            assert not kv.layer(layer + 1)[block_ids].any()
        seen.append((layer, list(block_ids)))

    first_layered = layered.pd.prefill_only("r", p, GREEDY, on_layer=on_layer)
    assert first_layered == first_fused
    assert [layer for layer, _ in seen] == list(range(tiny.config.num_layers))
    assert all(b == blocks_fused for _, b in seen)
    assert torch.equal(layered.kv_cache.tensor, fused.kv_cache.tensor)
    for e in (fused, layered):
        e.pd.release("r")
        assert e.num_free_blocks() == e.num_blocks and e.num_requests() == 0


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_pd_equals_colocated(tiny, sp):
    prompts = _prompts(tiny)
    requests = {str(i): (p, sp) for i, p in enumerate(prompts)}
    colocated = run_all(_engine(tiny), requests)
    prefill, decode = _engine(tiny, num_blocks=40), _engine(tiny, num_blocks=80)
    decode.block_manager.allocate([0], 17)  # decode's block ids differ from prefill's
    pd = run_pd(prefill, decode, requests)
    assert pd == colocated
    assert prefill.num_free_blocks() == prefill.num_blocks and prefill.num_requests() == 0
    assert decode.num_free_blocks() == decode.num_blocks - 5 and decode.num_requests() == 0


def test_pd_first_token_finishes_the_request(tiny):
    p = _prompts(tiny)[0]
    prefill, decode = _engine(tiny), _engine(tiny)
    sp = SamplingParams(max_tokens=1, temperature=0)
    decode.pd.reserve("r", len(p), 1)
    first = prefill.pd.prefill_only("r", p, sp)
    prefill.pd.release("r")
    decode.pd.add_prefilled("r", p, first, sp)
    outs = decode.step()
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "length" and outs[0].new_token_ids == []
    assert decode.num_free_blocks() == decode.num_blocks and not decode.has_unfinished()


def test_preemption_gives_the_same_tokens(tiny):
    prompts = _prompts(tiny)
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    requests = {str(i): (p, sp) for i, p in enumerate(prompts)}
    ample = run_all(_engine(tiny), requests)
    # 36 blocks of 4 tokens: all three fit at the start but not at their full length
    tight = _engine(tiny, num_blocks=36)
    got = run_all(tight, requests)
    assert tight.num_preemptions > 0
    assert got == ample
    assert tight.num_free_blocks() == tight.num_blocks


def test_prefill_many_equals_one_by_one(tiny):
    prompts = _prompts(tiny)
    single = _engine(tiny)
    firsts = {str(i): single.pd.prefill_only(str(i), p, SEEDED) for i, p in enumerate(prompts)}
    many = _engine(tiny)
    calls = []
    got = many.pd.prefill_many([(str(i), p, SEEDED) for i, p in enumerate(prompts)],
                               on_layer=lambda layer, rid, blocks, first: calls.append((layer, rid, blocks, first)))
    assert got == firsts
    n = len(prompts)
    # one forward for all: every layer's callbacks come together, each request's once per layer
    assert [layer for layer, *_ in calls] == [layer for layer in range(tiny.config.num_layers) for _ in range(n)]
    for i in range(n):
        rid = str(i)
        assert [(blocks, first) for _, r, blocks, first in calls[:n] if r == rid] == \
            [(many.pd.prefill_block_ids(rid), 0)]
        a = single.kv_cache.tensor[:, single.pd.prefill_block_ids(rid)]
        b = many.kv_cache.tensor[:, many.pd.prefill_block_ids(rid)]
        assert torch.allclose(a, b, atol=1e-6)
        single.pd.release(rid)
        many.pd.release(rid)
    assert many.num_free_blocks() == many.num_blocks and many.num_requests() == 0


def test_full_prefix_hit_computes_only_the_last_token(tiny):
    prompt = tiny.tokenizer.encode("exactly twelve")[:13]  # 13 tokens: 3 full blocks of 4 + 1
    assert len(prompt) == 13
    engine = _engine(tiny)
    first = run_all(engine, {"a": (prompt, GREEDY)})["a"]
    engine.add_request("b", prompt, GREEDY)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[0].num_cached_tokens == 12  # only the last prompt token was computed
    assert [t for o in outs for t in o.new_token_ids] == first == _dense_greedy(tiny, prompt, GREEDY.max_tokens)
    assert engine.num_free_blocks() == engine.num_blocks
