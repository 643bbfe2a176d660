"""Decode-side prefix reuse and cost-based disaggregation with real processes, real gRPC, both
KV transports: two decodes and four prefills on them, one per way of serving a prompt:

- ``reuse``    (defaults: --decode-reuse, --disaggregation always)
- ``noreuse``  (--no-decode-reuse: every prompt block moves, the picker ignores prefixes)
- ``local``    (--disaggregation never: the decode computes the prompt after its cached blocks)
- ``auto``     (--disaggregation auto: the cost model decides per request)

Multi-turn conversations (turn 2 = turn 1 + its answer + a new question):
- turn 2 goes to the decode that served turn 1 (its KV events say it holds the history);
- only the blocks it lacks move (decode metric ``pdserve_kv_prompt_blocks_total`` by source,
  the prefill's ``pdserve_kv_transfer_bytes_total``);
- greedy tokens are the colocated engine's, for every prefill (reuse on/off, local/remote);
- afterwards KV blocks, Sessions and CacheStore entries are back to zero everywhere.
"""

import pytest

from harness.conversations import (BS, ENGINE, MAX_TOKENS, blocks, colocated, conversation, generate,
                                   generate_counted, served_by, wait_index_caught_up)
from harness.pd_cluster import metric, nothing_held, start_decode, start_prefill, wait_all_released, wait_ready
from harness.procs import ProcessGroup

pytestmark = pytest.mark.slow
PREFILLS = {"reuse": [], "noreuse": ["--no-decode-reuse"], "local": ["--disaggregation", "never"],
            "auto": ["--disaggregation", "auto"]}


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def cluster(request, tmp_path_factory):
    transport = request.param
    group = ProcessGroup(log_dir=tmp_path_factory.mktemp(f"reuse-{transport}") / "logs")
    try:
        decodes = [start_decode(group, transport, 64, extra=ENGINE, name=f"decode{i}") for i in range(2)]
        for d in decodes:
            wait_ready(d)
        prefills = {name: start_prefill(group, [d.grpc_address for d in decodes], transport, 64, extra=ENGINE + flags,
                                        name=name) for name, flags in PREFILLS.items()}
        for p in prefills.values():
            wait_ready(p)
        yield {"transport": transport, "decodes": decodes, "prefills": prefills}
    finally:
        group.close()


def test_second_turn_goes_to_the_decode_with_the_history_and_moves_only_new_blocks(cluster):
    decodes, prefill = cluster["decodes"], cluster["prefills"]["reuse"]
    transport = cluster["transport"]
    convs = {f"{transport}-c{i}": conversation(i) for i in range(4)}
    first = {}
    for cid, (turn1, _) in convs.items():
        first[cid] = generate(prefill, f"{cid}-t1", turn1)
        assert len(first[cid]) == MAX_TOKENS
    # both decodes served some (weighted round robin on equal free memory)
    homes = {cid: served_by(decodes, f"{cid}-t1") for cid in convs}
    assert all(len(h) == 1 for h in homes.values()), homes
    assert {h[0] for h in homes.values()} == {"decode0", "decode1"}, homes
    bytes_per_block = (metric(prefill.url, "pdserve_kv_transfer_bytes_total")
                       / sum(blocks(len(t)) for t, _ in convs.values()))
    wait_index_caught_up(prefill, decodes)

    turn2 = {cid: turn1 + first[cid] + question for cid, (turn1, question) in convs.items()}
    expected = colocated({cid: ids for cid, ids in turn2.items()})
    by_name = {d.name: d for d in decodes}
    for cid, ids in turn2.items():
        home = by_name[homes[cid][0]]
        before = {s: metric(home.url, "pdserve_kv_prompt_blocks_total", source=s) for s in ("reused", "moved")}
        sent_before = metric(prefill.url, "pdserve_kv_transfer_bytes_total")
        assert generate(prefill, f"{cid}-t2", ids) == expected[cid]
        assert served_by(decodes, f"{cid}-t2") == homes[cid]
        # the decode kept turn 1's prompt and answer (its last token's KV is never computed)
        held = (len(convs[cid][0]) + MAX_TOKENS - 1) // BS
        reused = metric(home.url, "pdserve_kv_prompt_blocks_total", source="reused") - before["reused"]
        moved = metric(home.url, "pdserve_kv_prompt_blocks_total", source="moved") - before["moved"]
        assert (reused, moved) == (held, blocks(len(ids)) - held), (cid, reused, moved)
        assert metric(prefill.url, "pdserve_kv_transfer_bytes_total") - sent_before == moved * bytes_per_block
    readings = wait_all_released([prefill, *decodes])
    assert nothing_held(readings), readings


def test_greedy_tokens_equal_with_reuse_on_off_and_prompt_computed_here_or_there(cluster):
    decodes, prefills = cluster["decodes"], cluster["prefills"]
    transport = cluster["transport"]
    turn1, question = conversation(7)
    answer = colocated({"t1": turn1})["t1"]
    turn2 = turn1 + answer + question
    expected = colocated({"t2": turn2})["t2"]
    cached = {}  # prefill -> the cached_tokens its responses reported for turn 1 and turn 2
    reused_t2 = 0  # the decode's blocks the local prefill's turn 2 reused
    for name, prefill in prefills.items():
        rid = f"{transport}-{name}"
        got, hit1 = generate_counted(prefill, f"{rid}-t1", turn1)
        assert got == answer, name
        wait_index_caught_up(prefill, decodes)
        before = metric(prefill.url, "pdserve_kv_prompt_blocks_total", source="reused")
        got, hit2 = generate_counted(prefill, f"{rid}-t2", turn2)
        assert got == expected, name
        cached[name] = (hit1, hit2)
        if name == "local":
            reused_t2 = metric(prefill.url, "pdserve_kv_prompt_blocks_total", source="reused") - before
    # usage's cached_tokens: what the engine that computed the prompt did not compute. A prefill computing it
    # finds turn 1's full blocks in its own prefix cache on turn 2 (none on turn 1: a new conversation).
    for name in ("reuse", "noreuse"):
        assert cached[name] == (0, len(turn1) // BS * BS), (name, cached)
    assert cached["local"][1] == reused_t2 * BS > 0, (cached, reused_t2)  # the decode computed after its blocks
    # what each prefill did with its prompts
    assert metric(prefills["reuse"].url, "pdserve_kv_prompt_blocks_total", source="reused") > 0
    assert metric(prefills["noreuse"].url, "pdserve_kv_prompt_blocks_total", source="reused") == 0
    local = prefills["local"].url
    assert metric(local, "pdserve_disaggregation_decisions_total", decision="local", reason="never") == 2
    assert metric(local, "pdserve_kv_transfer_bytes_total") == 0
    assert metric(local, "pdserve_kv_prompt_blocks_total", source="computed") > 0
    assert metric(local, "pdserve_kv_prompt_blocks_total", source="reused") > 0  # turn 2 reused turn 1 there
    auto = prefills["auto"].url
    assert metric(auto, "pdserve_disaggregation_decisions_total", decision="remote", reason="unmeasured") >= 1
    assert metric(auto, "pdserve_disaggregation_decisions_total") == 2
    readings = wait_all_released([*prefills.values(), *decodes])
    assert nothing_held(readings), readings
