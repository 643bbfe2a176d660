"""Helpers for the decode-reuse tests: multi-turn conversations over gRPC Generate, which decode
served a request, the prefill's decode index caught up with the decodes' KV events, and the
colocated engine's greedy tokens to compare with. Block size ``BS`` on every server (``ENGINE``)."""

from __future__ import annotations

import time

import grpc

from harness.pd_cluster import get_json

BS = 16
ENGINE = ["--block-size", str(BS)]  # server flags for that block size
MAX_TOKENS = 12


def generate(prefill, rid: str, ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    return generate_counted(prefill, rid, ids, max_tokens)[0]


def generate_counted(prefill, rid: str, ids: list[int], max_tokens: int = MAX_TOKENS) -> tuple[list[int], int]:
    """Greedy tokens over gRPC Generate, and the prompt tokens the prefix cache held (``cached_tokens``)."""
    from pdserve.protos import generate_pb2 as gpb
    from pdserve.protos import generate_pb2_grpc as gpb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{prefill.grpc_port}") as ch:
        got, cached = [], []
        for resp in gpb_grpc.GeneratorStub(ch).Generate(gpb.GenerateRequest(
                prompt_token_ids=ids, max_tokens=max_tokens, temperature=0, ignore_eos=True,
                request_id=rid), timeout=120):
            got += list(resp.token_ids)
            cached.append(resp.cached_tokens)
        assert len(set(cached)) == 1, cached  # known from the first response on
        return got, cached[0]


def served_by(decodes, rid: str) -> list[str]:
    """Names of the decodes that had a Session for ``rid`` (their /debug/requests knows it)."""
    return [d.name for d in decodes if get_json(f"{d.url}/debug/requests/{rid}")[0] == 200]


def decode_seq(decode) -> int:
    from pdserve.protos import kv_events_pb2 as kpb
    from pdserve.protos import kv_events_pb2_grpc as kpb_grpc

    with grpc.insecure_channel(decode.grpc_address) as ch:
        return kpb_grpc.KvEventsStub(ch).Snapshot(kpb.SubscribeRequest(subscriber="test"), timeout=10).seq


def wait_index_caught_up(prefill, decodes, timeout: float = 10.0) -> None:
    """Until the prefill's index of every decode has applied the decode's events up to now
    (a prefill without decode reuse keeps no index)."""
    want = {d.grpc_address: decode_seq(d) for d in decodes}
    deadline = time.monotonic() + timeout
    while True:
        index = get_json(prefill.url + "/health")[1]["decode_index"]
        if index is None or all(index.get(a, {}).get("synced") and index[a]["seq"] >= seq for a, seq in want.items()):
            return
        assert time.monotonic() < deadline, f"the prefill's decode index never caught up: {index} vs {want}"
        time.sleep(0.05)


def colocated(prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    import torch

    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, load_model

    torch.set_num_threads(1)
    engine = LLMEngine(load_model("tiny"), EngineConfig(num_blocks=256, block_size=BS))
    out = {}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
        got = []
        while engine.has_unfinished():
            for o in engine.step():
                got += o.new_token_ids
        out[rid] = got
    return out


def conversation(i: int) -> tuple[list[int], list[int]]:
    """(turn 1 prompt, the new question of turn 2): distinct per i, several blocks long."""
    turn1 = [256] + [(7 * i + 3 * t) % 250 + 1 for t in range(70 + 9 * i)]
    question = [(11 * i + t) % 250 + 1 for t in range(20)]
    return turn1, question


def blocks(n_tokens: int) -> int:
    return -(-n_tokens // BS)
