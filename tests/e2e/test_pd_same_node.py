"""Same-node KV with real prefill and decode processes (``--kv-same-node``, cachestore/samenode.py).

Both servers run on this machine, so with the default ``--kv-same-node auto`` the decode shares its
CPU KV pool (a memfd) and the prefill copies each layer straight into it, telling the decode with
WRITTEN frames on the CacheStore control connection:

- greedy outputs equal the engine alone's, the same-node path was taken (a same-node link on the
  prefill, WRITTEN frames on the decode, no DATA byte over TCP), each layer delivered on its own;
- a corrupted slice (test hook) is refused by the decode's checksum, the client gets a clear error,
  the next request goes through;
- a prefill killed mid-transfer: the decode frees everything, as on tcp;
- ``--kv-same-node on`` at a prefill whose decode shares nothing fails the request naming why;
  ``auto`` falls back to tcp;
- nothing held afterwards (sessions, KV blocks, CacheStore entries), and nothing in /dev/shm: the
  pool is a memfd, which has no name there.
"""

import os
import subprocess
import sys

import pytest

from harness.conditions import wait_until
from harness.pd_cluster import (get_json, metric, nothing_held, post_json, start_decode, start_prefill,
                                wait_all_released, wait_ready)

pytestmark = pytest.mark.slow

PROMPTS = [[256] + [65 + (i * 7 + j) % 26 for j in range(n)] for i, n in enumerate((4, 63, 64, 149, 300))]
MAX_TOKENS = 10


def _shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if "pdserve-kv" in n}


def _memfds(pid: int) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if "memfd:pdserve-kv" in target:
            out.append(target)
    return out


def _engine_alone() -> list[list[int]]:
    import torch

    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, load_model

    torch.set_num_threads(1)
    engine = LLMEngine(load_model("tiny"), EngineConfig(num_blocks=64, max_num_seqs=8))
    for i, ids in enumerate(PROMPTS):
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[f"r{i}"] for i in range(len(PROMPTS))]


def _complete(prefill, ids):
    return post_json(prefill.url + "/v1/completions",
                     {"model": "tiny", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_same_node_outputs_equal_engine_alone_layer_by_layer(procs, transport):
    from pdserve.engine import load_model

    tokenizer = load_model("tiny").tokenizer
    expected = [tokenizer.decode(t) for t in _engine_alone()]
    decode = start_decode(procs, transfer=transport, same_node="auto", extra=["--kv-checksum"])
    wait_ready(decode)
    assert _memfds(decode.proc.pid), "the decode's KV pool is not in a memfd"
    prefill = start_prefill(procs, [decode.grpc_address], transfer=transport, same_node="auto",
                            extra=["--kv-checksum"])
    wait_ready(prefill)
    for ids, text in zip(PROMPTS, expected):
        status, body = _complete(prefill, ids)
        assert status == 200, body
        assert body["choices"][0]["text"] == text
    tx = get_json(prefill.url + "/health")[1]["cachestore"]
    rx = get_json(decode.url + "/health")[1]["cachestore"]
    assert tx["same_node_links"] == 1, tx
    assert rx["same_node_frames"] > 0 and rx["frames_verified"] == rx["frames_received"] > 0, rx
    assert rx["bytes_received"] == tx["bytes_sent"] > 0
    # each layer of each request delivered (store -> ACK) on its own: one observation per layer
    layers = metric(prefill.url, "pdserve_kv_transfer_layer_seconds_count")
    assert layers == len(PROMPTS) * load_model("tiny").config.num_layers, layers
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings
    procs.close()
    assert not _shm_names(), _shm_names()


def test_same_node_corrupted_kv_is_refused_and_nothing_held(procs):
    decode = start_decode(procs, same_node="auto", extra=["--kv-checksum"])
    wait_ready(decode)
    prefill = start_prefill(procs, [decode.grpc_address], same_node="on", extra=["--kv-checksum", "--resume-wait", "0"],
                            env={"PDSERVE_TEST_CORRUPT_KV": "1"})
    wait_ready(prefill)
    status, body = _complete(prefill, PROMPTS[3])
    # like tcp: a corrupted slice is never acknowledged, so prefill learns it before the first token
    assert status == 503, body
    assert "choices" not in body and "kv_checksum_mismatch" in body["error"]["message"], body
    assert metric(decode.url, "pdserve_kv_checksum_mismatches_total") == 1
    assert metric(prefill.url, "pdserve_kv_checksum_mismatches_total") == 1
    status, body = _complete(prefill, PROMPTS[3])
    assert status == 200 and body["usage"]["completion_tokens"] == MAX_TOKENS, body
    assert get_json(prefill.url + "/health")[1]["cachestore"]["same_node_links"] == 1
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings


def test_same_node_prefill_killed_mid_transfer_decode_frees(procs):
    decode = start_decode(procs, same_node="auto")
    wait_ready(decode)
    # 8 chunks of 256 tokens, each step >= 0.5 s (a test hook): the first chunk's layers are in the decode's pool
    # seconds before the last chunk's, on any CPU
    prefill = start_prefill(procs, [decode.grpc_address], same_node="on", extra=["--max-num-batched-tokens", "256"],
                            env={"PDSERVE_TEST_PREFILL_STEP_FLOOR_S": "0.5"})
    wait_ready(prefill)
    prompt = [256] + [97 + i % 26 for i in range(1999)]
    client = subprocess.Popen([sys.executable, "-c", f"""
import json, urllib.request
req = urllib.request.Request("{prefill.url}/v1/completions", json.dumps({{"model": "tiny", "prompt": {prompt}, "max_tokens": 4}}).encode(),
                             {{"Content-Type": "application/json"}})
try:
    urllib.request.urlopen(req, timeout=60).read()
except Exception:
    pass
"""], start_new_session=True)  # noqa: E501
    procs.procs.append(client)
    def mid_transfer() -> bool:  # the decode has allocated, some layers were written into its pool
        health = get_json(decode.url + "/health")[1]
        return bool(health["session_stages"].get("transfer", 0) and health["cachestore"]["same_node_frames"])

    wait_until(mid_transfer, "the request at the transfer stage by the same-node path", pause_s=0.005)
    procs.kill(prefill.proc)
    readings = wait_all_released([decode], timeout=5)
    assert nothing_held(readings), readings
    assert get_json(decode.url + "/health")[1]["kv_blocks_free"] == 64


def test_same_node_forced_or_refused(procs):
    decode = start_decode(procs, same_node="off")  # shares nothing
    wait_ready(decode)
    assert not _memfds(decode.proc.pid)
    forced = start_prefill(procs, [decode.grpc_address], same_node="on", name="forced",
                           extra=["--resume-wait", "0"])
    auto = start_prefill(procs, [decode.grpc_address], same_node="auto", name="auto")
    wait_ready(forced)
    wait_ready(auto)
    status, body = _complete(forced, PROMPTS[1])
    assert status >= 500 and "same-node KV transfer" in body["error"]["message"], body
    status, body = _complete(auto, PROMPTS[1])
    assert status == 200 and body["usage"]["completion_tokens"] == MAX_TOKENS, body
    assert get_json(auto.url + "/health")[1]["cachestore"]["same_node_links"] == 0
    rx = get_json(decode.url + "/health")[1]["cachestore"]
    assert rx["same_node_frames"] == 0 and rx["frames_received"] > 0, rx  # tcp DATA frames
    readings = wait_all_released([forced, auto, decode])
    assert nothing_held(readings), readings
