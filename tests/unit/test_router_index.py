"""The router's KV-event index (pure): snapshot then events; a gap, a new epoch or a broken
stream makes it forget a prefill's hashes; removal drops it; the same events give the same
index and the same choice."""

import random

import pytest

from pdserve.engine.block_manager import chained_hashes
from pdserve.router.choice import Candidate, choose
from pdserve.kv_index import CLEARED, REMOVED, STORED, PrefixIndex
from pdserve.router.prompt import prompt_hashes, prompt_key, prompt_token_ids, load_tokenizer

A, B = "10.0.0.1:50051", "10.0.0.2:50051"


def synced(hashes=(1, 2, 3), seq=5, epoch="e1"):
    index = PrefixIndex()
    assert index.apply_snapshot(A, epoch, seq, hashes, 16) == "initial"
    return index


def test_events_in_order_are_applied():
    index = synced()
    assert index.apply_event(A, "e1", 6, STORED, [4, 5]) == "applied"
    assert index.apply_event(A, "e1", 7, REMOVED, [1]) == "applied"
    assert index.view(A).hashes == {2, 3, 4, 5} and index.view(A).seq == 7
    assert index.apply_event(A, "e1", 7, STORED, [9]) == "duplicate"
    assert 9 not in index.view(A).hashes
    assert index.apply_event(A, "e1", 8, CLEARED, []) == "applied"
    assert index.view(A).hashes == set() and index.view(A).synced


def test_a_gap_forgets_the_prefill_until_a_snapshot():
    index = synced()
    assert index.overlap(A, [1, 2]) == 2
    assert index.apply_event(A, "e1", 8, STORED, [4]) == "gap"  # seq 6 and 7 never came
    view = index.view(A)
    assert not view.synced and view.hashes == set() and index.overlap(A, [1, 2]) == 0
    assert index.apply_event(A, "e1", 9, STORED, [5]) == "unsynced"  # nothing applies until the snapshot
    assert index.apply_snapshot(A, "e1", 9, [1, 2, 4, 5], 16) == "resync"
    assert index.overlap(A, [1, 2, 4]) == 3
    assert index.apply_event(A, "e1", 10, REMOVED, [2]) == "applied"
    assert index.overlap(A, [1, 2, 4]) == 1


def test_a_new_epoch_forgets_and_the_snapshot_says_restart():
    index = synced()
    assert index.apply_event(A, "e2", 1, STORED, [7]) == "epoch"
    assert index.view(A).hashes == set()
    assert index.apply_snapshot(A, "e2", 1, [7], 16) == "epoch"
    assert index.view(A).epoch == "e2" and index.view(A).hashes == {7}


def test_a_broken_stream_forgets_hashes_but_tells_restart_from_reconnect():
    index = synced()
    index.forget(A)
    assert index.overlap(A, [1]) == 0
    assert index.apply_event(A, "e1", 6, STORED, [4]) == "unsynced"
    assert index.apply_snapshot(A, "e1", 6, [1, 4], 16) == "resync"  # same process: a reconnect
    index.forget(A)
    assert index.apply_snapshot(A, "e9", 0, [], 16) == "epoch"  # another process: a restart


def test_removed_prefill_leaves_at_once():
    index = synced()
    index.apply_snapshot(B, "f1", 0, [1], 16)
    index.remove(A)
    assert index.servers() == [B] and index.view(A) is None and index.overlap(A, [1]) == 0


def test_overlap_counts_leading_blocks_only():
    index = synced(hashes=(1, 3))
    assert index.overlap(A, [1, 2, 3]) == 1
    assert index.overlap(A, [2, 1]) == 0


def test_two_indexes_fed_the_same_events_choose_the_same():
    rng = random.Random(3)
    events, seq, live = [], 0, set()
    for _ in range(400):
        seq += 1
        if live and rng.random() < 0.3:
            h = rng.choice(sorted(live))
            live.discard(h)
            events.append((seq, REMOVED, [h]))
        else:
            new = [rng.randrange(50) for _ in range(rng.randrange(1, 4))]
            live.update(new)
            events.append((seq, STORED, new))
    routers = [PrefixIndex(), PrefixIndex()]
    for index in routers:
        index.apply_snapshot(A, "e", 0, [], 16)
        index.apply_snapshot(B, "f", 0, [1, 2], 16)
        for s, kind, hashes in events:
            assert index.apply_event(A, "e", s, kind, hashes) == "applied"
    assert routers[0].view(A).hashes == routers[1].view(A).hashes == live
    for trial in range(50):
        prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
        choices = [choose([Candidate(p, ix.overlap(p, prompt), 1, 100, 16) for p in (A, B)], 16 * len(prompt) + 1,
                          prompt[0], 64.0) for ix in routers]
        assert choices[0] == choices[1]


def cand(address, overlap=0, in_flight=0, free=100, bs=16):
    return Candidate(address, overlap, in_flight, free, bs)


def test_choice_prefers_cached_prefix_then_load():
    c = choose([cand(A, 0), cand(B, 4)], 100, 0, 16.0)
    assert (c.address, c.reason, c.overlap_blocks, c.ranking) == (B, "prefix", 4, (B, A))
    # B's load (64 cached tokens vs 5 requests x 16) outweighs its prefix
    c = choose([cand(A, 0), cand(B, 4, in_flight=5)], 100, 0, 16.0)
    assert (c.address, c.reason) == (A, "load")
    # a prefill whose free blocks cannot hold what it must compute goes last
    c = choose([cand(A, 0, free=1), cand(B, 0, in_flight=3)], 100, 0, 16.0)
    assert c.address == B and c.reason == "balance"
    assert choose([cand(A, 2)], 100, 0, 16.0).reason == "single"
    with pytest.raises(ValueError):
        choose([], 10, 0, 1.0)


def test_ties_follow_the_prompt_and_spread_conversations():
    picks = {choose([cand(A), cand(B)], 50, key, 16.0).address for key in range(40)}
    assert picks == {A, B}  # different prompts spread
    assert len({choose([cand(B), cand(A)], 50, 7, 16.0).address for _ in range(5)} |
               {choose([cand(A), cand(B)], 50, 7, 16.0).address}) == 1  # order of candidates does not matter


def test_prompt_hashes_match_the_engine_and_skip_the_last_token():
    tok = load_tokenizer("tiny")
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"x" * 40 + b'"}]}'
    ids = prompt_token_ids(body, "chat", tok)
    assert ids == tok.encode(tok.apply_chat_template([{"role": "user", "content": "x" * 40}]))
    assert prompt_hashes(ids, 16) == chained_hashes(ids[: (len(ids) - 1) // 16 * 16], 16)
    assert prompt_hashes(list(range(32)), 16) == chained_hashes(list(range(16)), 16)  # last block holds the last token
    assert prompt_token_ids(b'{"prompt": [1, 2, 3]}', "completion", tok) == [1, 2, 3]
    assert prompt_token_ids(b'{"prompt": [[4, 5]]}', "completion", tok) == [4, 5]
    assert prompt_token_ids(b'{"prompt": []}', "completion", tok) == []
    for not_ids in (b'{"prompt": [1, true]}', b'{"prompt": [1, 2.0]}', b'{"prompt": [1, "2"]}',
                    b'{"prompt": [[1], 2]}'):
        assert prompt_token_ids(not_ids, "completion", tok) is None, not_ids  # JSON integers only
    assert prompt_token_ids(b'{"prompt": "hi"}', "completion", tok) == tok.encode("hi")
    for bad in (b"{not json", b'{"messages": 3}', b'{"prompt": 5}', b"[]"):
        assert prompt_token_ids(bad, "chat", tok) is None and prompt_token_ids(bad, "completion", tok) is None
    assert prompt_key(None, 16) == 0 and prompt_key([1, 2], 16) == prompt_key([1, 2], 16)


def _reference_ids(body: bytes, tok):
    """The general reading of a completion's prompt (json, then a check of each id), as the router did
    before msgspec: the fast path must give exactly this."""
    import json

    try:
        prompt = json.loads(body)["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return tok.encode(prompt)
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return prompt
    except Exception:  # noqa: BLE001
        return None
    return None


def test_token_id_prompts_read_in_c_are_the_general_readings():
    tok = load_tokenizer("tiny")
    bodies = [b'{"prompt": [1, 2, 3], "max_tokens": 4, "stream": true}',
              b'{"stream": false, "prompt": [0, -5, 9223372036854775807, -9223372036854775808]}',
              b'{"prompt": [18446744073709551615]}', b'{"prompt": [1e3]}', b'{"prompt": [1, null]}',
              b'{"prompt": [1, 2], "model": "caf\xc3\xa9", "extra": {"x": [true, 1.5]}}',
              b'{"prompt": [7], "prompt": [8, 9]}', b'{"prompt": [1, 2]} trailing', b'{"prompt": [1, 2,]}',
              b'{"prompt": [3]}', b'[1, 2]', b'{"prompt": {"a": 1}}', b'{"prompt": ["a"]}', b'{"prompt": [[1, 2]]}']
    for body in bodies:
        assert prompt_token_ids(body, "completion", tok) == _reference_ids(body, tok), body
