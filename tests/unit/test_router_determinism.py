"""Router replicas decide alike: two Router instances fed the same KV events and load reports pick the
same prefill (same reason, same ranking) for the same requests, whatever order the events of different
prefills arrive in; and a router in another process, with another PYTHONHASHSEED, picks the same too
(ties are broken by blake2b rendezvous hashes of the prompt, never by Python's salted hash or by
arrival order).

What a decision may depend on: the index (KV events), the prefills' load reports, and the requests
this router itself is relaying to each prefill at that moment (counted until the next load report
covers them). The last one is this replica's own, so under live traffic two replicas can differ for
up to one load interval; here neither relays anything, as after a quiet moment.
"""

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from pdserve.protos import kv_events_pb2 as kpb
from pdserve.kv_index import REMOVED, STORED, PrefixIndex
from pdserve.router.prefill_watch import PrefillWatch
from pdserve.router.prefills import PrefillSet
from pdserve.router.prompt import load_tokenizer, prompt_hashes, prompt_token_ids
from pdserve.router.router import Router
from pdserve.discovery import StaticDiscovery

PREFILLS = ["10.0.0.3:50051", "10.0.0.1:50051", "10.0.0.2:50051"]
BLOCK_SIZE = 16
SYSTEM = "You are a careful assistant. Answer briefly and cite nothing you have not read. " * 2


def conversation_bodies(rng: random.Random, n_conversations: int = 12, turns: int = 4) -> list[bytes]:
    """Chat bodies of multi-turn conversations sharing a system prompt (each turn appends to the history)."""
    bodies = []
    for c in range(n_conversations):
        messages = [{"role": "system", "content": SYSTEM}]
        for t in range(turns):
            messages.append({"role": "user", "content": f"conversation {c} turn {t}: " + "x" * rng.randrange(5, 60)})
            bodies.append(json.dumps({"model": "tiny", "messages": messages}).encode())
            messages = messages + [{"role": "assistant", "content": "ok " * rng.randrange(1, 20)}]
    return bodies


def event_streams(seed: int) -> dict[str, list[tuple[str, list[int]]]]:
    """Per prefill: the (kind, hashes) events its prefix cache published while serving a share of the
    conversations (every prompt's blocks stored; now and then blocks evicted)."""
    rng = random.Random(seed)
    tok = load_tokenizer("tiny")
    streams: dict[str, list] = {p: [] for p in PREFILLS}
    held: dict[str, set[int]] = {p: set() for p in PREFILLS}
    for body in conversation_bodies(rng):
        prefill = PREFILLS[rng.randrange(len(PREFILLS))] if rng.random() < 0.7 else PREFILLS[0]
        hashes = prompt_hashes(prompt_token_ids(body, "chat", tok), BLOCK_SIZE)
        new = [h for h in hashes if h not in held[prefill]]
        if new:
            streams[prefill].append((STORED, new))
            held[prefill].update(new)
        if held[prefill] and rng.random() < 0.25:
            gone = rng.sample(sorted(held[prefill]), k=min(3, len(held[prefill])))
            streams[prefill].append((REMOVED, gone))
            held[prefill].difference_update(gone)
    return streams


def loads(round_: int) -> dict[str, kpb.ServerLoad]:
    """Load reports (the same for every router): in flight and free blocks vary by prefill and round."""
    # round 0: all equally loaded, so requests no prefill has cached are decided by the tie-break alone
    return {p: kpb.ServerLoad(ready=True, in_flight=(i * 3 + round_) % 4 if round_ else 1, kv_blocks_free=500 - 40 * i,
                              kv_blocks_total=512, http_port=8000, block_size=BLOCK_SIZE)
            for i, p in enumerate(PREFILLS)}


def make_router(tok) -> Router:
    index = PrefixIndex()
    prefills = PrefillSet(StaticDiscovery(PREFILLS), index)
    for address in PREFILLS:  # what PrefillSet.reconcile makes, without starting the gRPC tasks
        # reports never expire here: on a loaded machine a round of decisions may outlast the default 1.5 s
        prefills.watches[address] = PrefillWatch(address, index, expiry_s=3600.0)
        index.apply_snapshot(address, f"epoch-{address}", 0, [], BLOCK_SIZE)
    return Router(prefills, index, tok)


def feed(router: Router, streams: dict, order: list[str]) -> None:
    """Apply every prefill's events in its own seq order, the prefills interleaved in ``order``'s rotation."""
    cursors = {p: 0 for p in PREFILLS}
    while any(cursors[p] < len(streams[p]) for p in PREFILLS):
        for p in order:
            if cursors[p] < len(streams[p]):
                kind, hashes = streams[p][cursors[p]]
                cursors[p] += 1
                assert router.index.apply_event(p, f"epoch-{p}", cursors[p], kind, hashes) == "applied"


def report(router: Router, round_: int) -> None:
    for address, load in loads(round_).items():
        watch = router.prefills.watches[address]
        watch.load, watch.load_at = load, time.monotonic()


def decisions(seed: int, order: list[str]) -> list[tuple]:
    """The choices of one router fed seed's events in ``order`` for seed's requests, as plain tuples."""
    async def run():
        tok = load_tokenizer("tiny")
        router = make_router(tok)
        try:
            feed(router, event_streams(seed), order)
            requests = conversation_bodies(random.Random(seed + 1))
            requests += [json.dumps({"model": "tiny", "messages": [{"role": "user", "content": f"{i} unrelated " * 9}]})
                         .encode() for i in range(12)]  # nothing cached anywhere
            out = []
            for round_ in range(3):
                report(router, round_)
                for body in requests:
                    choice = router.decide(prompt_token_ids(body, "chat", tok))
                    out.append((choice.address, choice.reason, choice.overlap_blocks, choice.ranking))
            return out
        finally:
            for watch in router.prefills.watches.values():
                await watch.stop()

    return asyncio.run(run())


def test_two_routers_fed_the_same_events_choose_the_same_prefills():
    a = decisions(7, PREFILLS)
    b = decisions(7, list(reversed(PREFILLS)))  # another interleaving of the prefills' streams
    assert a == b
    # not a trivial agreement: cached prefixes, load and the tie-break all decided some requests
    assert {reason for _, reason, _, _ in a} >= {"prefix", "load", "balance"}
    assert any(overlap > 0 for _, _, overlap, _ in a)
    per_round = len(a) // 3
    tie_broken = [address for address, reason, *_ in a[:per_round] if reason == "balance"]
    assert len(tie_broken) == 12 and len(set(tie_broken)) > 1  # equal loads: the rendezvous hash spreads them


def test_a_router_in_another_process_with_another_hash_seed_chooses_the_same():
    here = decisions(11, PREFILLS)
    tests_dir = Path(__file__).resolve().parent
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_router_determinism as t; "
            "print(json.dumps(t.decisions(11, t.PREFILLS)))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code, str(tests_dir)], capture_output=True, text=True, env=env,
                         timeout=120, check=True).stdout
    there = [(a, r, o, tuple(rank)) for a, r, o, rank in json.loads(out.splitlines()[-1])]
    assert there == here
