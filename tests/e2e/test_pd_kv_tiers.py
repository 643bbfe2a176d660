"""Prefix-cache tiers with real processes: a prefill (host tier, then disk) and a decode (host
tier), each with a KV pool far smaller than the working set of a multi-turn chat. Turn 2 of every
conversation finds its history evicted from the pools: the tiers bring it back
(``pdserve_kv_tier_hits_total`` on both servers), the greedy tokens equal the colocated engine's,
and afterwards no KV block, Session or CacheStore entry is held; once the servers stop, the disk
tier's directory is gone."""

import os

import pytest

from harness.conversations import ENGINE, MAX_TOKENS, colocated, conversation, generate, wait_index_caught_up
from harness.pd_cluster import metric, nothing_held, start_decode, start_prefill, wait_all_released, wait_ready
from harness.procs import ProcessGroup

pytestmark = pytest.mark.slow
POOL = 24  # blocks of 16 tokens per server; 6 conversations of ~8-10 blocks each
BLOCK_BYTES = 16384  # the tiny model: 4 layers x K,V x 16 tokens x 2 heads x 16 dims x 4 bytes


def test_multi_turn_chat_larger_than_the_pools_hits_the_tiers(tmp_path):
    disk = tmp_path / "disk"
    group = ProcessGroup(log_dir=tmp_path / "logs")
    try:
        decode = start_decode(group, "tcp", POOL, extra=ENGINE + ["--kv-host-tier-bytes", str(64 * BLOCK_BYTES)])
        prefill = start_prefill(group, [decode.grpc_address], "tcp", POOL, extra=ENGINE + [
            "--kv-host-tier-bytes", str(8 * BLOCK_BYTES), "--kv-disk-tier-dir", str(disk),
            "--kv-disk-tier-bytes", str(64 * BLOCK_BYTES)])  # both start at once: the prefill finds the decode
        wait_ready(decode)
        wait_ready(prefill)
        convs = {f"c{i}": conversation(i) for i in range(6)}
        turn2, got = {}, {}
        for cid, (turn1, question) in convs.items():
            answer = generate(prefill, f"{cid}-t1", turn1)
            assert len(answer) == MAX_TOKENS
            turn2[f"{cid}-t2"] = turn1 + answer + question
        wait_index_caught_up(prefill, [decode])
        for rid, ids in turn2.items():
            got[rid] = generate(prefill, rid, ids)
        assert got == colocated(turn2)
        for server in (prefill, decode):
            hits = metric(server.url, "pdserve_kv_tier_hits_total")
            assert hits > 0, f"{server.name}: no tier hits"
            assert metric(server.url, "pdserve_kv_tier_moved_bytes_total", direction="in") > 0
        assert metric(prefill.url, "pdserve_kv_tier_hits_total", tier="disk") > 0  # the host tier held only 8 blocks
        assert metric(prefill.url, "pdserve_kv_tier_bytes", tier="host") <= 8 * BLOCK_BYTES
        assert metric(prefill.url, "pdserve_kv_tier_checksum_mismatches_total") == 0
        (tier_dir,) = os.listdir(disk)  # one fresh folder, this prefill's
        assert os.listdir(disk / tier_dir), "the disk tier holds no block files"
        readings = wait_all_released([prefill, decode])
        assert nothing_held(readings), readings
    finally:
        group.close()
    assert os.listdir(disk) == [], "the disk tier's directory outlived its server"
