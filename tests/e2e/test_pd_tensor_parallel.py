"""P/D between tensor-parallel servers, through real processes (engine/tp/transfer.py): a prefill of TP size p
pushes its prompts' KV to a decode of TP size d, for (p, d) in (1, 2), (2, 1), (2, 2), over tcp and nixl (and
(2, 2) same-node: the decode's transfer pool mapped by the prefill). Each
server starts its own worker ranks (gloo on the CPU). Greedy tokens over gRPC equal the colocated TP 1 engine's
on the built-in model (2 KV heads: one per rank at TP 2), prompts long enough for chunked prefills; the
decode's load report counts its free blocks at one rank's bytes per block (its tightest rank: rank 0's
transfer pool is not KV room); afterwards every KV block, Session and CacheStore entry is free on both.
A pairing whose KV head shards do not nest (6 KV heads, P2 and D3) is refused by the decode, the request
failing with its reason naming both sizes.
"""

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from harness.pd_cluster import nothing_held, start_decode, start_prefill, wait_all_released, wait_ready
from harness.procs import ProcessGroup

pytestmark = pytest.mark.slow

NUM_BLOCKS = 48
MAX_TOKENS = 12
PROMPTS = {"r0": 7, "r1": 40, "r2": 150}  # prompt tokens (r2 takes several chunks at --max-num-batched-tokens 64)
SERVER = ("--threads", "1", "--block-size", "16", "--max-num-batched-tokens", "64")


# samenode: the decode's transfer pool (rank 0) in a memfd, the prefill writing into it (--kv-same-node on)
@pytest.fixture(scope="module", params=[(t, p, d) for t in ("tcp", "nixl") for p, d in ((1, 2), (2, 1), (2, 2))]
                + [("samenode", 2, 2)], ids=lambda v: f"{v[0]}-P{v[1]}-D{v[2]}")
def cluster(request, tmp_path_factory):
    transport, p, d = request.param
    wire, same_node = ("tcp", "on") if transport == "samenode" else (transport, "off")
    group = ProcessGroup(log_dir=tmp_path_factory.mktemp(f"pd-tp-{transport}-{p}-{d}") / "logs")
    try:
        decode = start_decode(group, wire, NUM_BLOCKS, extra=(*SERVER, "--tensor-parallel-size", str(d)),
                              same_node=same_node)
        prefill = start_prefill(group, [decode.grpc_address], wire, NUM_BLOCKS, same_node=same_node,
                                extra=(*SERVER, "--tensor-parallel-size", str(p), "--disaggregation", "always"))
        wait_ready(decode, timeout=300)
        wait_ready(prefill, timeout=300)
        yield {"prefill": prefill, "decode": decode, "decode_tp": d}
    finally:
        group.close()


@pytest.fixture(scope="module")
def colocated():
    import torch

    from harness.engine_runs import run_all
    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, load_model

    torch.set_num_threads(1)
    engine = LLMEngine(load_model("tiny"), EngineConfig(num_blocks=NUM_BLOCKS, block_size=16))
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return run_all(engine, {rid: (_ids(n), sp) for rid, n in PROMPTS.items()})


def _ids(n: int) -> list[int]:
    return [(i * 37 + n) % 256 for i in range(n)]


def _generate(address: str, rid: str, ids: list[int]) -> list[int]:
    from pdserve.protos import generate_pb2 as gpb
    from pdserve.protos import generate_pb2_grpc as gpb_grpc

    with grpc.insecure_channel(address) as ch:
        got = []
        for resp in gpb_grpc.GeneratorStub(ch).Generate(
                gpb.GenerateRequest(prompt_token_ids=ids, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                    request_id=rid), timeout=180):
            got += list(resp.token_ids)
        return got


def _load_report(address: str):
    from pdserve.protos import session_pb2 as pb
    from pdserve.protos import session_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as ch:
        return pb_grpc.DecodeStub(ch).GetLoadReport(pb.LoadReportRequest(), timeout=30)


def test_pd_between_tp_sizes_equals_colocated_tp1(cluster, colocated):
    prefill = cluster["prefill"]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = dict(zip(PROMPTS, pool.map(lambda r: _generate(prefill.grpc_address, r, _ids(PROMPTS[r])), PROMPTS)))
    assert got == colocated
    readings = wait_all_released([prefill, cluster["decode"]])
    assert nothing_held(readings), readings
    report = _load_report(cluster["decode"].grpc_address)
    # the built-in model: 4 layers, 2 KV heads of 16 float32 values; a rank holds 2 / d of them
    rank_block = 4 * 2 * 16 * (2 // cluster["decode_tp"]) * 16 * 4
    assert report.free_blocks == report.total_blocks == NUM_BLOCKS
    assert report.free_bytes == NUM_BLOCKS * rank_block


def test_a_pairing_whose_head_shards_do_not_nest_is_refused_naming_both_sizes(tmp_path):
    """6 KV heads: a prefill of TP 2 (3 heads a rank) and a decode of TP 3 (2 a rank) each start, but a decode
    rank's heads straddle two prefill ranks' shards: the decode refuses the Session, the request fails with
    the decode's reason naming both sizes, and nothing is held after."""
    from pdserve.engine import ModelConfig
    from pdserve.engine.checkpoint import random_hf_weights, save_hf_checkpoint

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=96, intermediate_size=96,
                      num_layers=1, num_heads=6, num_kv_heads=6, max_position_embeddings=256)
    save_hf_checkpoint(random_hf_weights(cfg, seed=5, std=0.15), cfg, tmp_path / "six")
    model = ("--model", str(tmp_path / "six"))
    group = ProcessGroup(log_dir=tmp_path / "logs")
    try:
        decode = start_decode(group, "tcp", NUM_BLOCKS, extra=(*SERVER, *model, "--tensor-parallel-size", "3"))
        prefill = start_prefill(group, [decode.grpc_address], "tcp", NUM_BLOCKS,
                                extra=(*SERVER, *model, "--tensor-parallel-size", "2", "--disaggregation", "always"))
        wait_ready(decode, timeout=300)
        wait_ready(prefill, timeout=300)
        with pytest.raises(grpc.RpcError) as err:
            _generate(prefill.grpc_address, "bad", _ids(20))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "prefill tensor-parallel size 2 and decode tensor-parallel size 3" in err.value.details(), \
            err.value.details()
        readings = wait_all_released([prefill, decode])
        assert nothing_held(readings), readings
    finally:
        group.close()
