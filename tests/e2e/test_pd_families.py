"""The newer model families through real P/D processes: a prefill and a decode serving a tiny
random Qwen3 checkpoint (sliding window on 2 of 3 layers, shorter than most prompts) and a
Qwen3-MoE one, both written by transformers; greedy tokens over gRPC equal the colocated
engine's, and afterwards every KV block, Session and CacheStore entry is free.
"""

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from harness.hf_checkpoints import WINDOW, save_tiny
from harness.pd_cluster import nothing_held, start_decode, start_prefill, wait_all_released, wait_ready
from harness.procs import ProcessGroup

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

NUM_BLOCKS = 64
REQUESTS = [("r0", 5, 20), ("r1", WINDOW + 1, 20), ("r2", 40, 20), ("r3", 70, 9)]  # (id, prompt tokens, max_tokens)


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def cluster(request, tmp_path_factory):
    family = request.param
    ckpt = save_tiny(family, tmp_path_factory.mktemp(f"ckpt-{family}"), seed=5)
    group = ProcessGroup(log_dir=tmp_path_factory.mktemp(f"pd-{family}") / "logs")
    model = ("--model", str(ckpt))
    try:
        decode = start_decode(group, "tcp", NUM_BLOCKS, extra=model)
        prefill = start_prefill(group, [decode.grpc_address], "tcp", NUM_BLOCKS, extra=model)  # both start at once
        wait_ready(decode)
        wait_ready(prefill)
        yield {"ckpt": ckpt, "prefill": prefill, "decode": decode}
    finally:
        group.close()


def _prompts(vocab):
    import random

    rng = random.Random(11)
    return {rid: ([rng.randrange(vocab) for _ in range(n)], max_tokens) for rid, n, max_tokens in REQUESTS}


def _colocated(ckpt, prompts):
    import torch

    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, load_model
    from harness.engine_runs import run_all

    torch.set_num_threads(1)
    engine = LLMEngine(load_model(str(ckpt)), EngineConfig(num_blocks=NUM_BLOCKS, max_num_seqs=8))
    return run_all(engine, {rid: (ids, SamplingParams(max_tokens=m, temperature=0))
                            for rid, (ids, m) in prompts.items()})


def _grpc_generate(address, rid, ids, max_tokens):
    from pdserve.protos import generate_pb2 as gpb
    from pdserve.protos import generate_pb2_grpc as gpb_grpc

    with grpc.insecure_channel(address) as ch:
        stub = gpb_grpc.GeneratorStub(ch)
        got = []
        for resp in stub.Generate(gpb.GenerateRequest(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0,
                                                      request_id=rid), timeout=120):
            got += list(resp.token_ids)
        return got


def test_pd_greedy_tokens_equal_colocated(cluster):
    prompts = _prompts(128)
    expected = _colocated(cluster["ckpt"], prompts)
    prefill = cluster["prefill"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = dict(zip(prompts, pool.map(lambda r: _grpc_generate(prefill.grpc_address, r, *prompts[r]), prompts)))
    for rid, (ids, max_tokens) in prompts.items():
        assert len(got[rid]) == max_tokens, rid
        assert got[rid] == expected[rid], f"{rid} ({len(ids)} prompt tokens) differs from colocated"
    readings = wait_all_released([prefill, cluster["decode"]])
    assert nothing_held(readings), readings
