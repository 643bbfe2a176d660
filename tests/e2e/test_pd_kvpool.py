"""The KV pool inside P/D, over real processes: a gManager, three ``pdserve decode --kv-pool``
with 8 blocks each (lending up to 7), one prefill; real gRPC, the tiny model.

- a greedy prompt longer than one decode's pool completes through the prefill with exactly
  the tokens of the engine's normal path on a pool that holds it (the decode borrowed from
  both peers; the prefill pushed each part of the prompt's KV straight to the decode or lender
  holding it); every block, loan, debt, Session and CacheStore entry comes back to zero;
- a client that goes away mid-request (here one whose prompt the decode computes itself:
  not one whole prompt block fits beside its generated tokens) leaves nothing behind;
- what the pool cannot serve gets a clear "too large" error at once: a request bigger than
  one decode plus all its peers can lend, and a long request that is not greedy;
- a lender SIGKILLed mid-request fails that request with an error naming the lender, and
  leaves nothing behind on the survivors (blocks, loans, the ledger).
"""

import random
import re
import threading

import grpc
import pytest

from harness.conditions import wait_until
from harness.pd_cluster import (get_json, metric, nothing_held, start_decode, start_prefill, wait_all_released,
                                wait_ready)
from harness.procs import ProcessGroup
from pdserve.net import free_port
from pdserve.protos import kvpool_pb2, kvpool_pb2_grpc

pytestmark = pytest.mark.slow

BLOCKS = 8  # 512 tokens (block size 64); lend fraction 7/8: each decode lends at most 7
LEND = ["--kv-pool-lend-fraction", "0.875"]


def _prompt(n, seed=0):
    rnd = random.Random(seed)
    return [rnd.randrange(32, 127) for _ in range(n)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    group = ProcessGroup(log_dir=tmp_path_factory.mktemp("pd-kvpool") / "logs")
    try:
        gm_port = free_port()
        group.pdserve("kvpool", "gmanager", "--port", str(gm_port), "--ttl", "2", name="gmanager")
        decodes = []
        for i in range(3):
            extra = ["--kv-pool", f"127.0.0.1:{gm_port}", "--kv-pool-port", str(free_port()),
                     "--kv-pool-instance-id", f"decode{i}", *LEND]
            decodes.append(start_decode(group, "tcp", BLOCKS, extra=extra, name=f"decode{i}"))
        for d in decodes:
            wait_ready(d)
        # --no-resume: a failed request ends with the decode's error (here: which lender died)
        prefill = start_prefill(group, [d.grpc_address for d in decodes], "tcp", 64, extra=["--no-resume"])
        wait_ready(prefill)
        channel = grpc.insecure_channel(f"127.0.0.1:{gm_port}")
        c = {"group": group, "prefill": prefill, "decodes": decodes, "gmanager": kvpool_pb2_grpc.GManagerStub(channel)}
        _wait(lambda: all(_pool(d)["pool_total_blocks"] == 14 for d in decodes), "every decode sees its peers' room")
        _wait(lambda: _largest_decode_as_the_prefill_sees_it(c) == BLOCKS + 14,
              "the prefill's load poller heard a decode's pool room")
        yield c
        channel.close()
    finally:
        group.close()


def _wait(cond, what, timeout=30.0):
    """Poll ``cond``; ``timeout`` is only a hang guard."""
    wait_until(cond, what, hang_guard_s=timeout, pause_s=0.1)


def _largest_decode_as_the_prefill_sees_it(c) -> int:
    """The most KV blocks the prefill's picker believes one decode holds, pool included: what it
    names when it refuses a request that no decode can ever hold (a probe of 24 blocks: refused at
    once, nothing allocated). 8 until a load report with the pool's room reached the picker."""
    with pytest.raises(grpc.RpcError) as err:
        _generate(c, "probe", _prompt(1500, seed=1), 12)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    return int(re.search(r"the largest decode holds only (\d+) KV blocks", err.value.details()).group(1))


def _pool(decode) -> dict:
    return get_json(decode.url + "/health")[1]["kv_pool"]


def _ledger(c) -> dict:
    return {r.lender: {d.borrower: d.blocks for d in r.lent}
            for r in c["gmanager"].GetLedger(kvpool_pb2.LedgerRequest()).rows}


def _settled(c, decodes) -> bool:
    pools = [_pool(d) for d in decodes]
    ledger = _ledger(c)
    return (all(p["loans"] == 0 and p["lent_blocks"] == 0 for p in pools)
            and all(ledger.get(p["instance_id"]) == {} for p in pools))


def _generate(c, rid, ids, max_tokens, temperature=0.0, into: list | None = None):
    """Greedy Generate through the prefill; ``into``: a list the tokens are appended to as they stream."""
    from pdserve.protos import generate_pb2 as gpb
    from pdserve.protos import generate_pb2_grpc as gpb_grpc

    with grpc.insecure_channel(c["prefill"].grpc_address) as ch:
        got = into if into is not None else []
        request = gpb.GenerateRequest(prompt_token_ids=ids, max_tokens=max_tokens, temperature=temperature,
                                      request_id=rid, ignore_eos=True)
        for resp in gpb_grpc.GeneratorStub(ch).Generate(request, timeout=180):
            got += list(resp.token_ids)
        return got


def _reference(prompt, max_tokens):
    """The engine's normal path on one pool that holds the whole request."""
    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, load_model

    engine = LLMEngine(load_model("tiny"), EngineConfig(num_blocks=32))
    engine.add_request("ref", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    out = []
    while engine.has_unfinished():
        out += [t for o in engine.step() for t in o.new_token_ids]
    return out


def _check_released(c, decodes):
    readings = wait_all_released([c["prefill"], *decodes], timeout=20)
    assert nothing_held(readings), readings
    _wait(lambda: _settled(c, decodes), "every loan and debt back to zero")
    for d in decodes:
        health = get_json(d.url + "/health")[1]
        assert health["engine_requests"] == 0 and health["kv_blocks_free"] == BLOCKS, (d.name, health)


def test_a_prompt_longer_than_one_decodes_pool_completes_over_pd_bit_exact(cluster):
    c = cluster
    # 21 blocks: 7 prompt blocks + the generated tokens here, 14 prompt blocks borrowed (7 + 7)
    prompt, max_tokens = _prompt(1300), 12
    before = sum(_pool(d)["pooled_requests_total"] for d in c["decodes"])
    got = _generate(c, "long", prompt, max_tokens)
    assert got == _reference(prompt, max_tokens)
    # the prefill pushed each part of the prompt's KV to where it lives: every decode received frames
    frames = [get_json(d.url + "/health")[1]["cachestore"]["frames_received"] for d in c["decodes"]]
    assert all(n > 0 for n in frames), frames
    pools = [_pool(d) for d in c["decodes"]]
    assert sum(p["pooled_requests_total"] for p in pools) == before + 1, pools
    assert sum(p["borrowed_blocks_total"] for p in pools) >= 13, pools
    assert sum(metric(d.url, "pdserve_kv_pool_pooled_requests_total") for d in c["decodes"]) == before + 1
    assert sum(metric(d.url, "pdserve_kv_pool_borrowed_blocks_total") for d in c["decodes"]) >= 13
    _check_released(c, c["decodes"])


def test_what_the_pool_cannot_serve_is_refused_as_too_large(cluster):
    c = cluster
    # 1500 + 12 tokens: 24 blocks; one decode holds 8 and its peers lend at most 14
    with pytest.raises(grpc.RpcError) as err:
        _generate(c, "huge", _prompt(1500, seed=1), 12)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "22" in err.value.details(), err.value.details()  # the largest decode holds 22 blocks, pool included
    # the pooled path is greedy: a sampled request bigger than one decode's pool can never fit
    with pytest.raises(grpc.RpcError) as err:
        _generate(c, "sampled", _prompt(1300, seed=2), 12, temperature=0.7)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "greedy" in err.value.details(), err.value.details()
    _check_released(c, c["decodes"])


def test_a_client_that_goes_away_mid_request_leaves_no_loan_behind(cluster):
    from pdserve.protos import generate_pb2 as gpb
    from pdserve.protos import generate_pb2_grpc as gpb_grpc

    c = cluster
    # 900 + 460 tokens: the generated ones leave room for 52 prompt tokens here, not one whole block:
    # the decode computes the prompt itself (ComputePrompt) and puts 848 tokens on its lenders (7 + 7 blocks)
    request = gpb.GenerateRequest(prompt_token_ids=_prompt(900, seed=5), max_tokens=460, temperature=0.0,
                                  request_id="gone", ignore_eos=True)
    with grpc.insecure_channel(c["prefill"].grpc_address) as ch:
        call = gpb_grpc.GeneratorStub(ch).Generate(request, timeout=180)
        next(call)  # the pooled request is decoding
        assert sum(_pool(d)["loans"] for d in c["decodes"]) == 2
        call.cancel()
    _check_released(c, c["decodes"])


def _in_background(c, rid, ids, max_tokens) -> tuple[threading.Thread, dict]:
    """A request on its own thread (started); the dict gets its "tokens" or its gRPC "error", and
    "streamed": the tokens received so far."""
    outcome = {"streamed": []}

    def run():
        try:
            outcome["tokens"] = _generate(c, rid, ids, max_tokens, into=outcome["streamed"])
        except grpc.RpcError as e:
            outcome["error"] = e

    worker = threading.Thread(target=run)
    worker.start()
    return worker, outcome


def test_a_lender_killed_mid_request_fails_only_that_request_and_leaves_nothing(cluster):
    c = cluster
    # 900 prompt tokens + 300 generated: 3 prompt blocks stay on the owner, 12 are borrowed (7 + 5)
    worker, outcome = _in_background(c, "victim", _prompt(900, seed=3), 300)
    lenders = []

    def borrowed_from_both():
        lenders[:] = [d for d in c["decodes"] if _pool(d)["loans"]]
        return len(lenders) == 2

    _wait(borrowed_from_both, "the request borrowed from both peers", timeout=60)
    # decoding now: its first token reached the client (the decode streams tokens as they come)
    _wait(lambda: outcome["streamed"] or "error" in outcome, "the request's first token", timeout=60)
    assert "error" not in outcome, outcome["error"].details()
    victim = lenders[0]
    c["group"].kill(victim.proc)
    worker.join(timeout=60)
    assert "tokens" not in outcome, "the request survived the loss of part of its KV"
    err = outcome["error"]
    assert "lender" in err.details() and _pool_name(victim) in err.details(), err.details()

    survivors = [d for d in c["decodes"] if d is not victim]
    _check_released(c, survivors)
    _wait(lambda: _pool_name(victim) not in _ledger(c), "the dead lender's row left the ledger")
    # the survivors still serve (a request that fits one decode)
    assert len(_generate(c, "after", _prompt(100, seed=4), 8)) == 8
    _check_released(c, survivors)


def _pool_name(decode) -> str:
    return decode.name  # --kv-pool-instance-id is the server's name here


def test_a_borrower_killed_mid_request_leaves_no_loan_behind(cluster):
    # after the lender test: two decodes are left (8 blocks each, lending 7)
    c = cluster
    alive = [d for d in c["decodes"] if d.proc.poll() is None]
    assert len(alive) == 2
    # 13 blocks: 8 on the borrower, 5 borrowed from the other
    worker, outcome = _in_background(c, "orphan", _prompt(600, seed=6), 200)
    lender = []

    def borrowed():
        lender[:] = [d for d in alive if _pool(d)["loans"]]
        return len(lender) == 1

    _wait(borrowed, "the request borrowed", timeout=60)
    borrower = next(d for d in alive if d is not lender[0])
    c["group"].kill(borrower.proc)
    worker.join(timeout=60)
    assert "error" in outcome, "the request finished though its decode was killed"
    # the lender frees the loan once the gManager no longer lists its borrower (ttl)
    _check_released(c, lender)
    assert _ledger(c) == {lender[0].name: {}}
