"""Failures around a reused prefix, with real processes: what a decode's prefix cache promises.

The defined answer (decode_server/session.py, step 2): the KV events a prefill picks a decode by
are a hint; the Allocation is the promise. The blocks it counts in ``cached_blocks`` are pinned
by the request's reservation until the session ends, so

- a flood of other requests while the prefill holds the session cannot evict them: the
  request reuses exactly what was promised and its greedy tokens are right;
- a prefix evicted before the Start (the advertisement was already stale) is simply not
  promised: the Allocation counts only what is left, the rest moves;
- a prefill killed while the decode pins a prefix: the decode frees the session at once and
  the prefix goes back to its cache (the next request reuses it again);
- a client gone while the decode computes the prompt itself: the decode frees everything.

Each test ends with KV blocks, Sessions and CacheStore entries back to zero on every process.
A prefill that must hold a session open (its prefix pinned) holds it at a gate the test opens
(harness/gates.py), between the decode's Allocation and its forward pass.
"""

import http.client
import json
import threading

import pytest

from harness.conversations import (BS, ENGINE, MAX_TOKENS, blocks, colocated, conversation, generate,
                                   wait_index_caught_up)
from harness.gates import Gate
from harness.pd_cluster import (get_json, metric, nothing_held, start_decode, start_prefill, wait_all_released,
                                wait_ready)

pytestmark = pytest.mark.slow

POOL = 24  # decode blocks: turn 2 of a conversation (8) plus one filler (16) fill it exactly
CUT_STREAM_STEP_FLOOR_S = 0.05  # the cut stream's 400 tokens last >= 20 s; the cancel takes milliseconds
HANG_GUARD_S = 60.0  # only a hang guard: a held request ends within seconds of its gate opening


def filler(i: int) -> list[int]:
    """A prompt unlike any conversation: 230 tokens + MAX_TOKENS need 16 blocks."""
    return [256] + [(13 * i + 5 * t) % 240 + 3 for t in range(229)]


def reused_and_moved(decode) -> tuple[float, float]:
    return (metric(decode.url, "pdserve_kv_prompt_blocks_total", source="reused"),
            metric(decode.url, "pdserve_kv_prompt_blocks_total", source="moved"))


def in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["tokens"] = fn(*args)
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_promised_prefix_is_pinned_and_an_evicted_one_is_not_promised(procs, tmp_path, transport):
    decode = start_decode(procs, transport, POOL, extra=ENGINE)
    wait_ready(decode)
    gate = Gate(tmp_path / "gate")
    plain = start_prefill(procs, [decode.grpc_address], transport, extra=ENGINE, name="plain")
    holding = start_prefill(procs, [decode.grpc_address], transport, extra=ENGINE, name="holding", env=gate.env)
    for p in (plain, holding):
        wait_ready(p)

    # 1. pinned: turn 2 is allocated (5 blocks promised), then three fillers recycle every other block
    turn1, question = conversation(1)
    answer = generate(plain, "a-t1", turn1)
    turn2 = turn1 + answer + question
    expected = colocated({"t2": turn2})["t2"]
    held = (len(turn1) + MAX_TOKENS - 1) // BS
    wait_index_caught_up(holding, [decode])
    before = reused_and_moved(decode)
    thread, out = in_thread(generate, holding, "a-t2", turn2)
    gate.wait_held(1)  # allocated: its prefix is promised (pinned), its KV not sent yet
    for i in range(3):
        assert len(generate(plain, f"fill-{i}", filler(i))) == MAX_TOKENS
    assert len(gate.held()) == 1 and thread.is_alive()  # it held its blocks through all three fillers
    gate.open()
    thread.join(HANG_GUARD_S)
    assert out.get("tokens") == expected, out
    after = reused_and_moved(decode)
    fillers_moved = 3 * blocks(len(filler(0)))
    assert (after[0] - before[0], after[1] - before[1]) == (held, blocks(len(turn2)) - held + fillers_moved)

    # 2. evicted before the Start: only what is left is promised, the rest moves; tokens still right
    turn1, question = conversation(2)
    answer = generate(plain, "b-t1", turn1)
    for i in range(3, 5):
        generate(plain, f"fill-{i}", filler(i))
    turn2 = turn1 + answer + question
    before = reused_and_moved(decode)
    assert generate(plain, "b-t2", turn2) == colocated({"t2": turn2})["t2"]
    after = reused_and_moved(decode)
    reused, moved = after[0] - before[0], after[1] - before[1]
    assert reused < (len(turn1) + MAX_TOKENS - 1) // BS and reused + moved == blocks(len(turn2)), (reused, moved)
    readings = wait_all_released([decode, plain, holding])
    assert nothing_held(readings), readings


def test_prefill_killed_while_a_prefix_is_pinned(procs, tmp_path):
    decode = start_decode(procs, "tcp", POOL, extra=ENGINE)
    wait_ready(decode)
    gate = Gate(tmp_path / "gate")  # never opened: the doomed prefill dies holding its session
    plain = start_prefill(procs, [decode.grpc_address], extra=ENGINE, name="plain")
    doomed = start_prefill(procs, [decode.grpc_address], extra=ENGINE, name="doomed", env=gate.env)
    for p in (plain, doomed):
        wait_ready(p)
    turn1, question = conversation(3)
    answer = generate(plain, "c-t1", turn1)
    turn2 = turn1 + answer + question
    held = (len(turn1) + MAX_TOKENS - 1) // BS
    wait_index_caught_up(doomed, [decode])
    thread, out = in_thread(generate, doomed, "c-t2-doomed", turn2)
    gate.wait_held(1)
    health = get_json(decode.url + "/health")[1]
    assert health["sessions"] == 1 and health["kv_blocks_used"] == blocks(len(turn2) + MAX_TOKENS), health
    procs.kill(doomed.proc)
    thread.join(HANG_GUARD_S)
    assert "error" in out, out
    readings = wait_all_released([decode])
    assert nothing_held(readings), readings
    # the stream broke: freed because the prefill was gone, not by the session timeout
    assert metric(decode.url, "pdserve_requests_total", outcome="cancelled", reason="prefill_gone") == 1
    assert metric(decode.url, "pdserve_requests_total", reason="timeout") == 0
    # the prefix went back to the cache: the next turn 2 reuses all of it
    before = reused_and_moved(decode)
    assert generate(plain, "c-t2", turn2) == colocated({"t2": turn2})["t2"]
    assert reused_and_moved(decode)[0] - before[0] == held
    readings = wait_all_released([decode, plain])
    assert nothing_held(readings), readings


def test_client_gone_while_the_decode_computes_the_prompt(procs):
    # every decode step lasts >= CUT_STREAM_STEP_FLOOR_S, so the 400-token stream outlasts the
    # client's close by many seconds on any CPU (a fast box once ran it to the end first)
    decode = start_decode(procs, "tcp", 64, extra=ENGINE, step_floor_s=CUT_STREAM_STEP_FLOOR_S)
    wait_ready(decode)
    prefill = start_prefill(procs, [decode.grpc_address], extra=ENGINE + ["--disaggregation", "never"])
    wait_ready(prefill)
    turn1, _ = conversation(4)
    conn = http.client.HTTPConnection("127.0.0.1", prefill.http_port, timeout=60)
    body = {"model": "tiny", "prompt": turn1, "max_tokens": 400, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # the decode computed the prompt and streams tokens
    assert get_json(decode.url + "/health")[1]["session_stages"] == {"decode": 1}
    conn.close()
    readings = wait_all_released([decode, prefill])
    assert nothing_held(readings), {k: {a: b for a, b in v.items() if b} for k, v in readings.items()}
    assert metric(prefill.url, "pdserve_disaggregation_decisions_total", decision="local", reason="never") == 1
    assert metric(decode.url, "pdserve_requests_total", outcome="cancelled") == 1
