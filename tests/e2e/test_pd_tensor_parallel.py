"""P/D between tensor-parallel servers, through real processes: a prefill of TP size p pushes its prompts' KV to a
decode of TP size d. Each server starts its own worker ranks (gloo on the CPU). Greedy tokens over gRPC equal the
colocated TP 1 engine's, prompts long enough for chunked prefills; afterwards every KV block, Session and
CacheStore entry (over every rank's sender and receiver) is free on both; the decode's load report counts its
free blocks at one rank's bytes per block (its tightest rank: rank 0's transfer pool is not KV room).

Which path moved the KV is asserted from both servers' /health ``kv_push`` counters:

- the per-rank push (engine/tp/rank_pools.py, prefill_server/rank_senders.py, decode_server/rank_receivers.py):
  each piece (heads of one decode rank from one prefill rank: engine/tp/heads.rank_pieces) on its prefill rank's
  own CacheStore sender, straight into the decode rank holding those heads, each piece's receiver counting every
  block of every layer; (P2, D2) on the built-in model (2 KV heads, one per rank); (P1, D2) on it, each decode
  rank getting a slice of the TP 1 prefill's heads packed contiguous (engine/tp/pieces.py); (P2, D1) on it, each
  prefill rank's head landing in a staging pool of the decode and unpacked into its pool; (P1, D2), (P2, D1) on
  a model of 1 KV head (replicated on the ranks of size 2); over tcp and nixl, and (P2, D2) same-node (each
  decode rank's pool mapped by the prefill);
- rank 0's gather/scatter (engine/tp/transfer.py), the fallback: (P2, D2) with a prefill started with
  ``--kv-push gather`` (it does not speak the per-rank push: the decode answers with rank 0's receiver).

On the tcp (P2, D2) cluster one rank's push fails first (the test hook ``PDSERVE_TEST_CORRUPT_KV=1`` on the
prefill's last rank's sender: its shard of the first request is corrupted in flight): the request ends in a
clear kv_checksum_mismatch error, nothing is held after, and the next requests are served.
A pairing whose KV head shards do not nest (6 KV heads, P2 and D3) is refused by the decode, the request
failing with its reason naming both sizes.
"""

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from harness.pd_cluster import (get_json, metric, nothing_held, post_json, start_decode, start_prefill,
                                wait_all_released, wait_ready)
from harness.procs import ProcessGroup
from pdserve.engine.tp.heads import rank_pieces
from pdserve.net import free_port

pytestmark = pytest.mark.slow

NUM_BLOCKS = 48
MAX_TOKENS = 12
PROMPTS = {"r0": 7, "r1": 40, "r2": 150}  # prompt tokens (r2 takes several chunks at --max-num-batched-tokens 64)
SERVER = ("--threads", "1", "--block-size", "16", "--max-num-batched-tokens", "64")
# (transport, prefill TP, decode TP, model, the path expected, prefill's extra flags)
CLUSTERS = [
    ("tcp", 2, 2, "tiny", "per_rank", ("--resume-wait", "0")),  # and one rank's push fails first (the hook)
    ("tcp", 1, 2, "tiny", "per_rank", ()),  # each decode rank a slice of the prefill's heads (packed)
    ("tcp", 2, 1, "tiny", "per_rank", ()),  # the decode's one rank both prefill ranks' heads (unpacked)
    ("tcp", 1, 2, "one_kv_head", "per_rank", ()),
    ("tcp", 2, 1, "one_kv_head", "per_rank", ()),
    ("tcp", 2, 2, "tiny", "gather", ("--kv-push", "gather")),
    ("nixl", 2, 2, "tiny", "per_rank", ()),
    ("nixl", 1, 2, "tiny", "per_rank", ()),
    ("nixl", 2, 1, "tiny", "per_rank", ()),
    ("samenode", 2, 2, "tiny", "per_rank", ()),
]
FAULT = "tcp-P2-D2-tiny-per_rank"


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory) -> str:
    """Llama-shaped, 4 heads over 1 KV head (replicated on both ranks at TP 2)."""
    from pdserve.engine import ModelConfig
    from pdserve.engine.checkpoint import random_hf_weights, save_hf_checkpoint

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=96,
                      num_layers=2, num_heads=4, num_kv_heads=1, max_position_embeddings=256)
    directory = tmp_path_factory.mktemp("llama-1kv")
    save_hf_checkpoint(random_hf_weights(cfg, seed=5, std=0.15), cfg, directory)
    return str(directory)


def _id(v) -> str:
    return f"{v[0]}-P{v[1]}-D{v[2]}-{v[3]}-{v[4]}"


# samenode: each decode rank's pool in a memfd, the prefill writing into it (--kv-same-node on)
@pytest.fixture(scope="module", params=CLUSTERS, ids=_id)
def cluster(request, tmp_path_factory, one_kv_head):
    transport, p, d, model_name, path, prefill_extra = request.param
    model = one_kv_head if model_name == "one_kv_head" else "tiny"
    wire, same_node = ("tcp", "on") if transport == "samenode" else (transport, "off")
    fault = _id(request.param) == FAULT
    group = ProcessGroup(log_dir=tmp_path_factory.mktemp(f"pd-tp-{_id(request.param)}") / "logs")
    try:
        ports = ",".join(str(free_port()) for _ in range(d + 2))  # the ranks' receivers, then head slices'
        decode = start_decode(group, wire, NUM_BLOCKS, same_node=same_node,
                              extra=(*SERVER, "--model", model, "--tensor-parallel-size", str(d),
                                     "--kv-rank-ports", ports))
        prefill = start_prefill(group, [decode.grpc_address], wire, NUM_BLOCKS, same_node=same_node,
                                env={"PDSERVE_TEST_CORRUPT_KV": "1"} if fault else None,
                                extra=(*SERVER, "--model", model, "--tensor-parallel-size", str(p),
                                       "--disaggregation", "always", *prefill_extra))
        wait_ready(decode, timeout=300)
        wait_ready(prefill, timeout=300)
        yield {"prefill": prefill, "decode": decode, "prefill_tp": p, "decode_tp": d, "model": model, "path": path,
               "fault": fault}
    finally:
        group.close()


@pytest.fixture(scope="module")
def colocated(one_kv_head):
    """The colocated TP 1 engine's greedy tokens, per model."""
    import torch

    from harness.engine_runs import run_all
    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, load_model

    torch.set_num_threads(1)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    out = {}
    for model in ("tiny", one_kv_head):
        engine = LLMEngine(load_model(model), EngineConfig(num_blocks=NUM_BLOCKS, block_size=16))
        out[model] = run_all(engine, {rid: (_ids(n), sp) for rid, n in PROMPTS.items()})
    return out


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


def _kv_push(server) -> dict:
    return get_json(server.url + "/health")[1]["kv_push"] or {}


def _one_rank_push_fails(cluster) -> None:
    """The hook corrupts the prefill's last rank's shard of the first request: a clear error, nothing held, the
    mismatch counted once on each side."""
    prefill, decode = cluster["prefill"], cluster["decode"]
    body = {"model": "tiny", "prompt": _ids(150), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    status, answer = post_json(prefill.url + "/v1/completions", body)
    assert status in (502, 503), answer
    assert "choices" not in answer and "kv_checksum_mismatch" in answer["error"]["message"], answer
    assert metric(decode.url, "pdserve_kv_checksum_mismatches_total") == 1
    assert metric(prefill.url, "pdserve_kv_checksum_mismatches_total") == 1
    assert _kv_push(prefill)["shards_sent"][-1] == 0  # the last rank's shard never arrived whole
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings


def test_pd_between_tp_sizes_equals_colocated_tp1(cluster, colocated):
    prefill, decode = cluster["prefill"], cluster["decode"]
    if cluster["fault"]:
        _one_rank_push_fails(cluster)
    before = _kv_push(prefill)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = dict(zip(PROMPTS, pool.map(lambda r: _generate(prefill.grpc_address, r, _ids(PROMPTS[r])), PROMPTS)))
    assert got == colocated[cluster["model"]]
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings
    sent, received = _kv_push(prefill), _kv_push(decode)
    if cluster["path"] == "per_rank":  # every decode rank got its heads of each request, piece by piece
        p, d, heads = cluster["prefill_tp"], cluster["decode_tp"], 2 if cluster["model"] == "tiny" else 1
        pieces = rank_pieces(heads, p, d)
        assert pieces is not None
        assert sum(sent["shards_sent"]) - sum(before["shards_sent"]) == len(PROMPTS) * len(pieces), sent
        assert sent["whole_heads"] == before["whole_heads"], sent
        assert received["shards_received"] == [len(PROMPTS)] * d, received
        packed = sum(not x.whole_source for x in pieces)  # (P1, D2) on 2 KV heads: both pieces are slices
        assert sent["sliced"] - before["sliced"] == len(PROMPTS) * packed, sent
        assert received["unpacked"] == len(PROMPTS) * sum(not x.whole_dest for x in pieces), received
        if cluster["prefill_tp"] == cluster["decode_tp"]:  # rank to rank: each of our ranks sent its own shard
            assert all(n >= len(PROMPTS) for n in sent["shards_sent"]), sent
    else:  # every head on the one sender (through rank 0's transfer pool at TP > 1), no rank's receiver used
        assert not any(received.get("shards_received", [])) and not any(sent.get("shards_sent", [])), (sent, received)
        assert sent.get("whole_heads", len(PROMPTS)) == len(PROMPTS), sent
    report = _load_report(decode.grpc_address)
    # 2 KV heads of 16 float32 values a rank holds 2 / d of (tiny: 4 layers); 1 KV head on every rank (2 layers)
    tiny = cluster["model"] == "tiny"
    rank_block = (4 if tiny else 2) * 2 * 16 * ((2 // cluster["decode_tp"]) if tiny else 1) * 16 * 4
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
