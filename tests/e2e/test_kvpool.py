"""The KV pool over real processes: a gManager and three decodes (``pdserve kvpool``), real gRPC.

A prompt too long for one decode's pool spans all three: the tokens equal the engine's normal
path on a pool big enough to hold it, the logits equal the dense reference within 1e-4, and
every block and debt comes back. A lender SIGKILLed mid-request fails exactly that request,
naming the lender, and leaves no block or debt behind; the survivors go on pooling.
"""

import random
import threading

import grpc
import pytest
import torch

from pdserve.bench.experiments.kvpool_cluster import KVPoolCluster
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.loader import load_model
from pdserve.engine.sampling import SamplingParams
from pdserve.test_hooks import KVPOOL_GATE_ENV as TEST_GATE_ENV

from harness.gates import Gate

pytestmark = pytest.mark.slow

BLOCKS = 8  # 512 tokens per decode; reserve 1 -> the pool holds 8 + 7 + 7 blocks for one request


def _prompt(n, seed=0):
    rnd = random.Random(seed)
    return [rnd.randrange(32, 127) for _ in range(n)]


def _settled(cluster: KVPoolCluster) -> bool:
    stats = [cluster.stats(name) for name in cluster.ports]
    ledger = cluster.ledger()
    return (all(s.free_blocks == s.num_blocks and s.loans == 0 and s.engine_requests == 0 for s in stats)
            and set(ledger) == set(cluster.ports) and all(row == {} for row in ledger.values()))


_REFERENCE = []


def reference():
    """The tiny model (same weights as the decodes) and the engine's normal path on a pool that
    holds the whole request: (loaded, expected(prompt, max_tokens) -> greedy token ids)."""
    if not _REFERENCE:
        loaded = load_model("tiny", seed=0)
        engine = LLMEngine(loaded, EngineConfig(num_blocks=32))

        def expected(prompt, max_tokens):
            engine.add_request("ref", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            out = []
            while engine.has_unfinished():
                out += [t for o in engine.step() for t in o.new_token_ids]
            return out

        _REFERENCE.append((loaded, expected))
    return _REFERENCE[0]


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    """The decodes' gate (open: requests pass; a test closes it to hold a pooled request with its loans taken)."""
    return Gate(tmp_path_factory.mktemp("kvpool-gate"), opened=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, gate):
    # one cluster for the module (the kill test goes last: it takes a decode away)
    with pytest.MonkeyPatch.context() as mp:  # the decodes inherit our environment
        mp.setenv(TEST_GATE_ENV, str(gate.directory))
        with KVPoolCluster(3, BLOCKS, reserve=1, log_dir=tmp_path_factory.mktemp("kvpool") / "logs") as c:
            yield c


def test_a_request_spanning_three_decodes_equals_the_engines_normal_path(cluster):
    prompt, max_tokens = _prompt(1300), 12
    reply = cluster.generate("decode-0", "long", prompt, max_tokens, pooled=True, return_logits=True)
    assert sorted(reply.lenders) == ["decode-1", "decode-2"], "the overflow did not span the other two decodes"
    assert reply.local_blocks == BLOCKS

    loaded, expected = reference()
    expected = expected(prompt, max_tokens)
    assert list(reply.token_ids) == expected

    dense = loaded.model.forward_dense(torch.tensor(prompt + expected[:-1]))[len(prompt) - 1 :]
    logits = torch.frombuffer(bytearray(reply.logits), dtype=torch.float32).view(max_tokens, -1)
    assert (logits - dense).abs().max().item() < 1e-4

    # the same prompt does not fit one decode alone: the engine says so
    with pytest.raises(grpc.RpcError, match="needs 21 KV blocks"):
        cluster.generate("decode-0", "alone", prompt, max_tokens, pooled=False)
    cluster.wait(lambda: _settled(cluster), "every block and debt back to zero")


def test_two_decodes_borrowing_at_once_under_the_same_request_id(cluster):
    # request ids are unique per decode only: two loans "same" on one lender must not mix.
    # A (decode-0, 620 + 200 tokens) borrows 5 blocks from decode-1 (ties go by name); while it
    # runs decode-0 has no free block, so B (decode-2, 620 + 8) borrows its 2 from decode-1 too.
    a_prompt, b_prompt, replies = _prompt(620, seed=5), _prompt(620, seed=6), {}
    worker = threading.Thread(target=lambda: replies.update(a=cluster.generate("decode-0", "same", a_prompt, 200,
                                                                               pooled=True)))
    worker.start()
    cluster.wait(lambda: cluster.stats("decode-1").loans == 1, "A borrowed from decode-1")
    replies["b"] = cluster.generate("decode-2", "same", b_prompt, 8, pooled=True)
    worker.join(timeout=120)
    _, expected = reference()
    assert (list(replies["a"].lenders), replies["a"].borrowed_blocks) == (["decode-1"], 5)
    # decode-1, not decode-0: B borrowed while A still held all of decode-0's blocks
    assert (list(replies["b"].lenders), replies["b"].borrowed_blocks) == (["decode-1"], 2)
    assert list(replies["a"].token_ids) == expected(a_prompt, 200)
    assert list(replies["b"].token_ids) == expected(b_prompt, 8)
    cluster.wait(lambda: _settled(cluster), "every block and debt back to zero")


def test_a_restarted_gmanager_rebuilds_the_ledger_from_the_rmanagers_reports(cluster, gate):
    outcome = {}
    gate.close()  # the request is held with its loans taken until the ledger is rebuilt (however fast it decodes)
    worker = threading.Thread(target=lambda: outcome.update(reply=cluster.generate(
        "decode-0", "through-restart", _prompt(900, seed=4), 200, pooled=True)))
    worker.start()
    try:
        assert gate.wait_held(1) == ["through-restart"]
        assert cluster.stats("decode-1").loans == 1, "the request borrowed"
        cluster.restart_gmanager()  # SIGKILL: the new one starts with an empty ledger
        cluster.wait(lambda: cluster.ledger().get("decode-1") == {"decode-0": 7}, "the ledger rebuilt from reports")
    finally:
        gate.open()
    worker.join(timeout=120)
    assert len(outcome["reply"].token_ids) == 200, "the request did not survive the gManager's restart"
    cluster.wait(lambda: _settled(cluster), "every block and debt back to zero")


def test_a_lender_killed_mid_request_fails_only_that_request_and_leaves_nothing(cluster):
    outcome = {}

    def run():
        try:
            outcome["reply"] = cluster.generate("decode-0", "victim", _prompt(900, seed=1), 300, pooled=True)
        except grpc.RpcError as e:
            outcome["error"] = e

    # 900 prompt tokens + 300 generated: 11 blocks of overflow, 7 on decode-1 and 4 on decode-2
    worker = threading.Thread(target=run)
    worker.start()
    # killed as soon as both hold part of its KV: whether the borrower still waits for decode-2's Lend reply
    # (Borrower.borrow), is putting the prompt's KV there (PutKV) or already decoding (Attend), the lender's
    # silence fails the request the same way (LenderLost naming it); no phase of it can be told apart from
    # outside (the Lend reply lost with decode-2 once ended as "had only 7 to lend", RESOURCE_EXHAUSTED)
    cluster.wait(lambda: cluster.stats("decode-2").loans == 1 and cluster.stats("decode-1").loans == 1,
                 "the request borrowed from both peers")
    cluster.kill("decode-2")
    worker.join(timeout=60)
    assert "reply" not in outcome, "the request survived the loss of part of its KV"
    err = outcome["error"]
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "decode-2" in err.details() and "victim" in err.details()

    # the dead lender's row leaves the ledger; the survivors hold nothing
    cluster.wait(lambda: _settled(cluster), "blocks and debts back to zero after the lender died")
    # the survivors still pool: decode-1's overflow borrows from decode-0 only
    reply = cluster.generate("decode-1", "after", _prompt(900, seed=2), 8, pooled=True)
    assert list(reply.lenders) == ["decode-0"] and len(reply.token_ids) == 8
    cluster.wait(lambda: _settled(cluster), "back to zero after the next request")


def test_a_borrower_killed_mid_request_leaves_no_loan_behind(cluster):
    # after the lender test: decode-0 and decode-1 are left; decode-1 borrows 7 blocks from decode-0
    outcome = {}

    def run():
        try:
            outcome["reply"] = cluster.generate("decode-1", "orphan", _prompt(500, seed=3), 400, pooled=True)
        except grpc.RpcError as e:
            outcome["error"] = e

    worker = threading.Thread(target=run)
    worker.start()
    # the borrower dies holding a loan (its phase does not matter: the lender frees by the gManager's ttl)
    cluster.wait(lambda: cluster.stats("decode-0").loans == 1, "decode-1 borrowed from decode-0")
    cluster.kill("decode-1")
    worker.join(timeout=60)
    assert outcome["error"].code() == grpc.StatusCode.UNAVAILABLE  # the borrower itself is gone
    # decode-0 frees the loan once the gManager no longer lists its borrower (ttl)
    cluster.wait(lambda: _settled(cluster), "the dead borrower's loan freed and its debt gone")
    assert cluster.ledger() == {"decode-0": {}}
