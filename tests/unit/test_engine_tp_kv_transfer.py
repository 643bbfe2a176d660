"""KV in and out of tensor-parallel engines (engine/tp/transfer.py), in one process: a prefill engine of TP
size p pushes its prompts' KV layer by layer (``prefill_only``'s ``on_layer``, the blocks copied out of its
``transfer_cache`` as the CacheStore reads them) into a decode engine of TP size d (into its ``transfer_cache``,
as the CacheStore writes them; ``add_prefilled`` scatters them to the ranks), and the decode's greedy tokens
equal the colocated TP 1 engine's, for (p, d) in (1, 2), (2, 1), (2, 2): on the built-in model (2 KV heads, one
per rank) and on a Qwen2-shaped one with 1 KV head (replicated on both ranks); with a prefix cached on the
decode (only the blocks after it move) and chunked prefills (each chunk's blocks pushed as written); TP 4 with
replicated heads (P4 -> D2, P1 -> D4). After each run every block of both engines is free. A decode whose worker
died before the scatter fails the request naming the rank and calls ``on_lost`` (its server exits there),
though no step runs. With ``kv_checksum`` a shard corrupted on rank 0's hop fails its requests, not the engine.
(A TP engine without ``kv_transfer`` refuses to move KV: test_engine_tensor_parallel.py.)
The per-rank push (tp/rank_pools.py) in one process: each decode rank's blocks copied layer by layer from the
pool of the prefill rank holding its heads, as rank 0 maps every rank's pool (``rank_pools``), the decode told the
KV landed in its ranks' pools: tokens equal colocated TP 1 for (P2, D2) on the built-in model and (P1, D2),
(P2, D1), (P2, D2) with one replicated KV head, with neither engine's transfer pool ever written (no gather, no
scatter) and the prefill's pushing steps all per rank.
"""

import asyncio
import os
import signal

import pytest
import torch

from harness.conditions import until

from harness.engine_runs import last_moved, run_all, run_pd
from pdserve.engine import AsyncLLMEngine, EngineConfig, LLMEngine, ModelConfig, SamplingParams, load_model
from pdserve.engine.errors import ShardChecksumError, TensorParallelError
from pdserve.engine.tp.heads import rank_sources
from pdserve.engine.checkpoint import random_hf_weights, save_hf_checkpoint

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PAIRS = [(1, 2), (2, 1), (2, 2)]


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory) -> str:
    """Qwen2-shaped: q/k/v biases, 4 heads over 1 KV head (replicated on both ranks at TP 2)."""
    cfg = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=131, hidden_size=64, intermediate_size=96,
                      num_layers=2, num_heads=4, num_kv_heads=1, max_position_embeddings=256, attention_bias=True)
    directory = tmp_path_factory.mktemp("qwen2-1kv")
    save_hf_checkpoint(random_hf_weights(cfg, seed=5, std=0.15), cfg, directory)
    return str(directory)


def _engine(model: str, tp: int, **config) -> LLMEngine:
    loaded = load_model(model, tensor_parallel_size=tp)
    return LLMEngine(loaded, EngineConfig(num_blocks=48, block_size=8, tensor_parallel_size=tp, kv_transfer=True,
                                          **config))


def _requests(vocab: int, lengths=(9, 30, 17)) -> dict:
    gen = torch.Generator().manual_seed(7)
    return {f"r{i}": (torch.randint(0, vocab, (n,), generator=gen).tolist(), GREEDY) for i, n in enumerate(lengths)}


def _colocated(model: str, requests: dict) -> dict:
    engine = _engine(model, 1)
    try:
        return run_all(engine, requests)
    finally:
        engine.close()


def _all_free(*engines: LLMEngine) -> None:
    for e in engines:
        assert e.num_free_blocks() == e.num_blocks
        assert not e.has_unfinished() and not e.scheduler.seqs


@pytest.mark.parametrize("model", ["tiny", "one_kv_head"])
def test_pd_between_tp_sizes_equals_colocated_tp1(model, request):
    model = "tiny" if model == "tiny" else request.getfixturevalue(model)
    vocab = 256 if model == "tiny" else 131
    requests = _requests(vocab)
    expected = _colocated(model, requests)
    for p, d in PAIRS:
        prefill, decode = _engine(model, p), _engine(model, d)
        try:
            got = run_pd(prefill, decode, requests)
            assert got == expected, f"P{p} -> D{d}"
            _all_free(prefill, decode)
        finally:
            prefill.close()
            decode.close()


def _run_per_rank(prefill: LLMEngine, decode: LLMEngine, requests: dict) -> dict:
    """run_pd's requests with the per-rank push: every decode rank's heads of a layer's blocks copied from the pool
    of the prefill rank holding them, after every prefill rank wrote the layer (the on_layer's ``kv_direct``)."""
    sources = rank_sources(prefill.model_config.num_kv_heads, prefill.config.tensor_parallel_size,
                           decode.config.tensor_parallel_size)
    assert sources is not None
    src_pools, dst_pools = prefill.rank_pools, decode.rank_pools
    out: dict[str, list[int]] = {}
    for rid, (ids, sp) in requests.items():
        dst = decode.pd.reserve(rid, len(ids), sp.max_tokens)

        def on_layer(layer: int, src: list[int], first: int, dst=dst) -> None:
            for d, s in enumerate(sources):
                for a, b in zip(src, dst[first:first + len(src)]):
                    dst_pools[d].tensor[layer][b].copy_(src_pools[s].tensor[layer][a])

        setattr(on_layer, "kv_direct", True)
        first = prefill.pd.prefill_only(rid, ids, sp, on_layer=on_layer)
        prefill.pd.release(rid)
        decode.kv_landed.add(rid)
        decode.pd.add_prefilled(rid, ids, first, sp)
        decode.kv_landed.discard(rid)  # (a TP 1 decode has no scatter to take it)
        out[rid] = [first]
    while decode.has_unfinished():
        for o in decode.step():
            out[o.request_id].extend(o.new_token_ids)
    return out


@pytest.mark.parametrize("model, pairs", [("tiny", [(2, 2)]), ("one_kv_head", PAIRS)])
def test_the_per_rank_push_equals_colocated_tp1_without_the_transfer_pools(model, pairs, request):
    model = "tiny" if model == "tiny" else request.getfixturevalue(model)
    requests = _requests(256 if model == "tiny" else 131, lengths=(9, 30))
    expected = _colocated(model, requests)
    for p, d in pairs:
        prefill, decode = _engine(model, p), _engine(model, d)
        try:
            assert len(prefill.rank_pools) == p and len(decode.rank_pools) == d
            assert _run_per_rank(prefill, decode, requests) == expected, f"P{p} -> D{d}"
            for engine in (prefill, decode):  # rank 0's transfer pool: never gathered into, never scattered from
                if engine.config.tensor_parallel_size > 1:
                    assert not engine.transfer_cache.tensor.any()
            if p > 1:
                assert prefill.kv_pushes["gather"] == 0 and prefill.kv_pushes["per_rank"] > 0
            _all_free(prefill, decode)
        finally:
            prefill.close()
            decode.close()


def test_a_cached_prefix_on_the_decode_and_chunked_prefills():
    """(P2, D2): the second request shares its first 3 blocks with the first, cached on the decode (only the
    blocks after them move); the prefill cuts each prompt in chunks of 8 tokens (each chunk's blocks pushed)."""
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 256, (24,), generator=gen).tolist()
    requests = {"a": (shared + [5, 6, 7], GREEDY), "b": (shared + [9, 10, 11, 12, 13], GREEDY)}
    expected = _colocated("tiny", requests)
    prefill = _engine("tiny", 2, max_num_batched_tokens=8, long_prefill_threshold=8, enable_prefix_cache=False)
    decode = _engine("tiny", 2)
    try:
        assert run_pd(prefill, decode, requests, reuse=True) == expected
        assert last_moved["b"] == 1  # 4 prompt blocks, 3 cached
        _all_free(prefill, decode)
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("p, d", [(4, 2), (1, 4)])
def test_tp4_with_replicated_kv_heads(p, d):
    """TP 4 on the built-in model's 2 KV heads: each head on two ranks (replicated), on either side."""
    requests = _requests(256, lengths=(12, 26))
    expected = _colocated("tiny", requests)
    prefill, decode = _engine("tiny", p), _engine("tiny", d)
    try:
        assert run_pd(prefill, decode, requests) == expected
        _all_free(prefill, decode)
    finally:
        prefill.close()
        decode.close()


def test_the_transfer_pool_holds_every_kv_head_and_each_rank_only_its_own():
    """A TP 2 engine's pool holds 1 of the built-in model's 2 KV heads, its transfer pool (the CacheStore's
    region) both: the blocks on the wire are a TP 1 pool's."""
    engine = _engine("tiny", 2)
    try:
        assert engine.kv_cache.num_kv_heads == 1
        assert engine.transfer_cache.num_kv_heads == 2 and engine.transfer_cache.num_blocks == engine.num_blocks
        assert engine.transfer is not None and engine.transfer.rank_heads == [range(0, 1), range(1, 2)]
    finally:
        engine.close()


def test_a_rank_lost_at_the_scatter_fails_the_request_and_calls_on_lost():
    """The scatter runs in a call (add_prefilled), not a step: the AsyncLLMEngine still hears the loss."""
    engine = _engine("tiny", 2)
    lost: list[BaseException] = []

    async def main():
        aeng = AsyncLLMEngine(engine)
        aeng.on_lost = lost.append
        await aeng.start()
        try:
            await aeng.reserve("r", 3, 4)
            os.kill(engine.runner.steps.procs[0].pid, signal.SIGKILL)
            with pytest.raises(TensorParallelError, match="tensor-parallel rank 1"):
                async for _ in aeng.add_prefilled("r", [1, 2, 3], 4, GREEDY):
                    pass
            await until(lambda: lost, "on_lost called")
        finally:
            await aeng.stop()

    try:
        asyncio.run(main())
    finally:
        engine.close()
    assert len(lost) == 1 and isinstance(lost[0], TensorParallelError) and "rank 1" in str(lost[0])


def _flip_first_byte(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1).view(torch.uint8)[0] ^= 0xFF
    return t


def test_a_shard_corrupted_on_rank_0s_hop_fails_its_requests_and_the_ranks_stay_in_step():
    """kv_checksum: rank 1's shard of a pushed layer is corrupted as it reaches rank 0 (the gather's result
    altered, once): the prefill's requests of that step fail with kv_checksum_mismatch and nothing of the
    corrupted layer is handed to on_layer; rank 0's shard corrupted as it is scattered at a decode: add_prefilled
    fails, the reservation stays for the caller's abort. Then both engines serve the next request as TP 1 does."""
    requests = _requests(256, lengths=(20,))
    expected = _colocated("tiny", requests)
    prefill, decode = _engine("tiny", 2, kv_checksum=True), _engine("tiny", 2, kv_checksum=True)
    try:
        real_gather, real_scatter = prefill.runner.steps.group.gather, decode.runner.steps.group.scatter
        layers: list[int] = []

        def corrupt_gather(t, small=False):
            prefill.runner.steps.group.gather = real_gather  # once
            parts = real_gather(t, small)
            return [parts[0], _flip_first_byte(parts[1])]

        prefill.runner.steps.group.gather = corrupt_gather
        with pytest.raises(ShardChecksumError, match="kv_checksum_mismatch: tensor-parallel rank\\(s\\) \\[1\\]"):
            prefill.pd.prefill_only("bad", requests["r0"][0], GREEDY, on_layer=lambda layer, *a: layers.append(layer))
        assert 0 not in layers

        def corrupt_scatter(parts, out=None):
            decode.runner.steps.group.scatter = real_scatter  # once
            return _flip_first_byte(real_scatter(parts, out))

        decode.runner.steps.group.scatter = corrupt_scatter
        decode.pd.reserve("bad", 20, 4)
        with pytest.raises(ShardChecksumError, match="did not land intact"):
            decode.pd.add_prefilled("bad", requests["r0"][0], 7, GREEDY)
        decode.abort("bad")
        _all_free(prefill, decode)
        assert prefill.tensor_parallel_lost is None and decode.tensor_parallel_lost is None
        assert run_pd(prefill, decode, requests) == expected
        _all_free(prefill, decode)
    finally:
        prefill.close()
        decode.close()
