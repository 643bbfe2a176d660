"""Tensor parallelism (engine/tp/) on the CPU with gloo, two ranks (rank 0 here, one worker process).

TP 2 against TP 1 on the same checkpoint: greedy tokens identical and the logits of every step within
float32 tolerance, on every dense family the engine has (Llama: the built-in model, 4 heads / 2 KV heads
split; Qwen2 with q/k/v biases, one KV head replicated on both ranks and a vocabulary of odd size, padded;
Mistral; Qwen3, Gemma 2, Gemma 3 from transformers' checkpoints: q/k norms, sliding windows, a tied LM
head) and on the MoE one (Qwen3-MoE: each expert split, the router whole); chunked prefill, prefix-cache
hits and prompt logprobs under TP 2. The ranks' shards of the built-in model are the TP 1 weights sliced.
A worker killed mid-stream fails the next step with one line naming its rank; the engine is lost and its
other workers gone, and the AsyncLLMEngine ends the streams and calls ``on_lost`` (a server exits there).
On the CPU the small collectives go through shared memory by default; gloo alone gives the same tokens, and
the segment leaves /dev/shm before the first step. After close() no worker is left running. The server flags
that clash with TP > 1 are refused in one line; KV never crosses the pool of a TP engine made without
``kv_transfer`` (P/D between TP servers: test_engine_tp_kv_transfer.py, e2e/test_pd_tensor_parallel.py).
"""

import argparse
import asyncio
import os
import signal

import pytest
import torch

from harness.conditions import until, wait_until
from harness.engine_runs import record_step_logits, run_all
from harness.hf_checkpoints import build_tiny
from pdserve.engine import AsyncLLMEngine, ConfigError, EngineConfig, LLMEngine, ModelConfig, SamplingParams, load_model
from pdserve.engine.checkpoint import random_hf_weights, save_hf_checkpoint
from pdserve.engine.errors import TensorParallelError
from pdserve.engine.tp.shard import ShardError
from pdserve.server_setup import check_tensor_parallel

TOL = 1e-4
STEPS = 12
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)  # each rank one thread (the workers take rank 0's count)


def _llama_like(directory, architecture: str, **fields) -> str:
    shape = dict(vocab_size=131, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=1,
                 max_position_embeddings=256)
    cfg = ModelConfig(architecture=architecture, **{**shape, **fields})
    save_hf_checkpoint(random_hf_weights(cfg, seed=5, std=0.15), cfg, directory)
    return str(directory)


def _checkpoint(family: str, tmp_path) -> str:
    if family == "llama":
        return "tiny"
    if family == "qwen2":  # q/k/v biases; one KV head (replicated on both ranks); vocabulary 131 (padded to 2 x 66)
        return _llama_like(tmp_path / family, "Qwen2ForCausalLM", attention_bias=True)
    if family == "mistral":
        return _llama_like(tmp_path / family, "MistralForCausalLM")
    build_tiny(family, seed=3).save_pretrained(str(tmp_path / family))
    return str(tmp_path / family)


def _engine(model: str, tp: int, **config) -> LLMEngine:
    loaded = load_model(model, tensor_parallel_size=tp)
    return LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=8, tensor_parallel_size=tp, **config))


def _run(model: str, tp: int, requests: dict, **config):
    """(tokens per request, logits of every step) of a fresh engine, closed after."""
    engine = _engine(model, tp, **config)
    try:
        seen = record_step_logits(engine)
        return run_all(engine, requests), seen
    finally:
        engine.close()


def _prompts(vocab: int) -> dict:
    gen = torch.Generator().manual_seed(11)
    return {str(i): (torch.randint(0, vocab, (n,), generator=gen).tolist(), GREEDY) for i, n in enumerate((9, 30))}


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3", "gemma2", "gemma3", "qwen3_moe"])
def test_tp2_greedy_tokens_and_logits_equal_tp1(family, tmp_path):
    model = _checkpoint(family, tmp_path)
    requests = _prompts(128)
    one, one_logits = _run(model, 1, requests)
    two, two_logits = _run(model, 2, requests)
    assert two == one
    assert len(two_logits) == len(one_logits) == STEPS
    for step, (a, b) in enumerate(zip(one_logits, two_logits)):
        assert a.shape == b.shape and (a - b).abs().max().item() <= TOL, f"step {step}"


def test_shared_memory_collectives_give_gloos_tokens_and_leave_nothing_in_dev_shm():
    """The CPU ranks' small collectives through shared memory (the default) against gloo for every one."""
    requests = _prompts(128)
    runs = {}
    for shm in (True, False):
        engine = _engine("tiny", 2, tensor_parallel_shm=shm)
        try:
            segment = engine.runner.steps.group.shm
            assert (segment is not None) == shm
            if segment is not None:  # unlinked once every rank mapped it (before the first step)
                assert not [f for f in os.listdir("/dev/shm") if f.startswith(os.path.basename(segment.path))]
            seen = record_step_logits(engine)
            runs[shm] = run_all(engine, requests), seen
        finally:
            engine.close()
    assert runs[True][0] == runs[False][0]
    for a, b in zip(runs[True][1], runs[False][1]):
        assert (a - b).abs().max().item() <= TOL


def test_chunked_prefill_prefix_hits_and_prompt_logprobs_under_tp2():
    long = [256, *range(40, 140)]  # 101 tokens: chunks of 16 under a budget of 32
    with_logprobs = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=2)
    config = dict(max_num_batched_tokens=32, long_prefill_threshold=16)
    results = {}
    for tp in (1, 2):
        engine = _engine("tiny", tp, **config)
        try:
            first = run_all(engine, {"long": (long, GREEDY), "short": ([256, 72, 105], GREEDY)})
            hits = engine.prefix_hit_tokens()
            again = run_all(engine, {"again": (long + first["long"][:5], GREEDY)})  # its first blocks are cached
            assert engine.prefix_hit_tokens() - hits >= 96
            engine.add_request("lp", long[:40], with_logprobs)
            lps = [o.prompt_logprobs for o in _drain(engine) if o.prompt_logprobs]
            results[tp] = (first, again, lps[0])
            assert engine.num_free_blocks() == engine.num_blocks
        finally:
            engine.close()
    assert results[2][:2] == results[1][:2]
    for a, b in zip(results[1][2][1:], results[2][2][1:]):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=TOL)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def _drain(engine: LLMEngine) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_the_ranks_shards_are_the_tp1_weights_sliced():
    whole = load_model("tiny").model.state_dict()
    ranks = [load_model("tiny", tensor_parallel_size=2, rank=r).model.state_dict() for r in (0, 1)]
    for name in ("layers.1.q_proj.weight", "layers.1.k_proj.weight", "layers.1.v_proj.weight",
                 "layers.1.gate_proj.weight", "layers.1.up_proj.weight", "lm_head.weight"):
        rows = torch.cat([r[name] for r in ranks])  # (the LM head's padded to 2 x 129 rows)
        assert torch.equal(rows[: whole[name].shape[0]], whole[name]) and not rows[whole[name].shape[0] :].any(), name
    for name in ("layers.1.o_proj.weight", "layers.1.down_proj.weight"):
        assert torch.equal(torch.cat([r[name] for r in ranks], dim=1), whole[name]), name
    assert torch.equal(ranks[1]["embed_tokens.weight"], whole["embed_tokens.weight"])  # replicated


def test_close_leaves_no_worker_running():
    engine = _engine("tiny", 2)
    procs = engine.runner.steps.procs
    assert procs and all(p.poll() is None for p in procs)
    run_all(engine, {"a": ([256, 72, 105], GREEDY)})
    engine.close()
    wait_until(lambda: all(p.poll() is not None for p in procs), "every worker exited after close()")
    assert [p.returncode for p in procs] == [0]


def test_a_killed_rank_fails_the_next_step_naming_it_and_the_engine_stays_lost():
    engine = _engine("tiny", 2)
    try:
        engine.add_request("r", [256, 72, 105], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
        engine.step()
        worker = engine.runner.steps.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        named = rf"tensor-parallel rank 1 \(pid {worker.pid}\) exited with code -9"
        with pytest.raises(TensorParallelError, match=named):
            engine.step()
        with pytest.raises(TensorParallelError, match="rank 1"):  # lost for good: every later step says so
            engine.step()
    finally:
        engine.close()


def test_sizes_that_do_not_split_the_model_are_refused_naming_the_problem(tmp_path):
    with pytest.raises(ShardError, match="tensor-parallel size 3 does not divide the model's 4 attention heads"):
        load_model("tiny", tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 but the model was loaded for 1 rank\(s\)"):
        LLMEngine(load_model("tiny"), EngineConfig(tensor_parallel_size=2))
    with pytest.raises(ShardError, match="tensor-parallel size 2 does not divide the model's MLP intermediate size "
                                         "95"):
        load_model(_llama_like(tmp_path / "odd", "LlamaForCausalLM", intermediate_size=95), tensor_parallel_size=2)
    with pytest.raises(ShardError, match="size 4 and the model's 6 KV heads: one must divide the other"):
        load_model(_llama_like(tmp_path / "kv", "LlamaForCausalLM", num_heads=12, num_kv_heads=6, hidden_size=96),
                   tensor_parallel_size=4)
    with pytest.raises(ValueError, match="KV tiers with tensor parallelism"):
        EngineConfig(tensor_parallel_size=2, kv_host_tier_bytes=1 << 20)
    assert issubclass(ShardError, ValueError) and not issubclass(ShardError, ConfigError)


def test_the_async_engine_fails_the_streams_and_calls_on_lost_when_a_rank_dies():
    """What a server hears (it exits there: server_setup.exit_server): the streams end with the one line."""
    engine = _engine("tiny", 2)
    lost: list[BaseException] = []

    async def main():
        aeng = AsyncLLMEngine(engine)
        aeng.on_lost = lost.append
        await aeng.start()
        outs = []
        async for out in aeng.generate("r", [256, 72, 105], SamplingParams(max_tokens=200, temperature=0,
                                                                           ignore_eos=True)):
            if not outs:
                os.kill(engine.runner.steps.procs[0].pid, signal.SIGKILL)
            outs.append(out)
        await until(lambda: lost, "on_lost called")
        await aeng.stop()
        return outs[-1]

    try:
        last = asyncio.run(main())
    finally:
        engine.close()
    assert last.finish_reason == "abort" and "tensor-parallel rank 1" in last.error
    assert isinstance(lost[0], TensorParallelError) and "rank 1" in str(lost[0])


def _server_args(**flags) -> argparse.Namespace:
    base = dict(tensor_parallel_size=2, engine="builtin", disaggregation="never", kv_pool="", eviction=True)
    return argparse.Namespace(**{**base, **flags})


def test_server_flags_that_clash_with_tensor_parallelism_are_refused_in_one_line():
    with pytest.raises(SystemExit, match="--tensor-parallel-size 2 needs the built-in engine"):
        check_tensor_parallel(_server_args(engine="vllm"), "decode")
    check_tensor_parallel(_server_args(disaggregation="always"), "prefill")  # P/D at TP > 1: KV moves (transfer.py)
    with pytest.raises(SystemExit, match="--kv-pool needs --tensor-parallel-size 1"):
        check_tensor_parallel(_server_args(kv_pool="gm:1"), "decode")
    with pytest.raises(SystemExit, match="--tensor-parallel-size must be >= 1, got 0"):
        check_tensor_parallel(_server_args(tensor_parallel_size=0), "decode")
    args = _server_args()
    check_tensor_parallel(args, "decode")
    assert args.eviction is False  # each rank holds only its KV heads: nothing is evicted to host memory


def test_kv_never_crosses_the_pool_of_a_tensor_parallel_engine_without_kv_transfer():
    """Without EngineConfig.kv_transfer (its transfer pool) a TP engine refuses to push KV or take pushed KV
    (test_engine_tp_kv_transfer.py: with it); computing a reserved prompt here is allowed."""
    engine = _engine("tiny", 2)
    try:
        assert engine.transfer is None and engine.transfer_cache is engine.kv_cache
        with pytest.raises(ValueError, match="KV cannot move out of or into this tensor-parallel engine"):
            engine.pd.prefill_only("p", [256, 72], GREEDY, on_layer=lambda *a: None)
        engine.pd.reserve("d", 2, 4)
        with pytest.raises(ValueError, match="KV cannot move"):
            engine.pd.add_prefilled("d", [256, 72], 105, GREEDY)
        engine.pd.prefill_reserved("d", [256, 72], GREEDY)  # computed here: allowed
        assert sum(len(o.new_token_ids) for o in _drain(engine)) == STEPS and engine.num_requests() == 0
    finally:
        engine.close()
