"""The newer model families through real P/D processes: a prefill and a decode serving a tiny
random Qwen3 checkpoint (sliding window on 2 of 3 layers, shorter than most prompts) and a
Qwen3-MoE one, both written by transformers; FP8 weights too: the Qwen3-MoE checkpoint in the
compressed-tensors FP8 layout (``harness/fp8_checkpoints.py``) and the Qwen3 one quantized at load
(``--quantization fp8``). Greedy tokens over gRPC equal the colocated engine's on the same weights,
and afterwards every KV block, Session and CacheStore entry is free.
"""

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from harness.fp8_checkpoints import quantize_checkpoint
from harness.hf_checkpoints import WINDOW, save_tiny
from harness.pd_cluster import nothing_held, start_decode, start_prefill, wait_all_released, wait_ready
from harness.procs import ProcessGroup

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

NUM_BLOCKS = 64
REQUESTS = [("r0", 5, 20), ("r1", WINDOW + 1, 20), ("r2", 40, 20), ("r3", 70, 9)]  # (id, prompt tokens, max_tokens)


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe", "qwen3_moe-fp8-checkpoint", "qwen3-quantization-fp8"])
def cluster(request, tmp_path_factory):
    variant = request.param
    family = variant.split("-")[0]
    ckpt = save_tiny(family, tmp_path_factory.mktemp(f"ckpt-{variant}"), seed=5)
    quantization = None
    if variant.endswith("fp8-checkpoint"):
        ckpt = quantize_checkpoint(ckpt, ckpt.parent / "fp8", "ct-channel")
    elif variant.endswith("quantization-fp8"):
        quantization = "fp8"
    group = ProcessGroup(log_dir=tmp_path_factory.mktemp(f"pd-{variant}") / "logs")
    model = ("--model", str(ckpt), *(("--quantization", quantization) if quantization else ()))
    try:
        decode = start_decode(group, "tcp", NUM_BLOCKS, extra=model)
        prefill = start_prefill(group, [decode.grpc_address], "tcp", NUM_BLOCKS, extra=model)  # both start at once
        wait_ready(decode)
        wait_ready(prefill)
        yield {"ckpt": ckpt, "prefill": prefill, "decode": decode, "quantization": quantization}
    finally:
        group.close()


def _prompts(vocab):
    import random

    rng = random.Random(11)
    return {rid: ([rng.randrange(vocab) for _ in range(n)], max_tokens) for rid, n, max_tokens in REQUESTS}


def _colocated(ckpt, prompts, quantization=None):
    import torch

    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, load_model
    from harness.engine_runs import run_all

    torch.set_num_threads(1)
    engine = LLMEngine(load_model(str(ckpt), quantization=quantization),
                       EngineConfig(num_blocks=NUM_BLOCKS, max_num_seqs=8))
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
    expected = _colocated(cluster["ckpt"], prompts, cluster["quantization"])
    prefill = cluster["prefill"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = dict(zip(prompts, pool.map(lambda r: _grpc_generate(prefill.grpc_address, r, *prompts[r]), prompts)))
    for rid, (ids, max_tokens) in prompts.items():
        assert len(got[rid]) == max_tokens, rid
        assert got[rid] == expected[rid], f"{rid} ({len(ids)} prompt tokens) differs from colocated"
    readings = wait_all_released([prefill, cluster["decode"]])
    assert nothing_held(readings), readings
