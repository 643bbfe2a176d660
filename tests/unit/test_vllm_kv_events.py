"""VllmKvEvents (vllm_backend/kv_events.py) as pure logic: vLLM's prefix-cache events, with vLLM's own
hashes, become the pdserve block hashes a router computes from the same prompt (``router/prompt.py``),
counted per vLLM hash, with partial and keyed blocks left out. The events here are stand-ins with vLLM
0.32's field names; tests/vllm/test_vllm_backend.py checks the real engine's events end to end."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from pdserve.engine.block_manager import chained_hashes
from pdserve.vllm_backend.kv_events import VllmKvEvents

BS = 4


@dataclass
class BlockStored:
    block_hashes: list
    parent_block_hash: object
    token_ids: list[int]
    block_size: int = BS
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: list | None = None
    group_idx: int | None = 0


@dataclass
class BlockRemoved:
    block_hashes: list
    group_idx: int | None = 0


@dataclass
class AllBlocksCleared:
    pass


@dataclass
class Listener:
    log: list = field(default_factory=list)
    held: set = field(default_factory=set)

    def stored(self, hashes):
        self.log.append(("stored", list(hashes)))
        self.held |= set(hashes)

    def removed(self, hashes):
        self.log.append(("removed", list(hashes)))
        self.held -= set(hashes)

    def cleared(self):
        self.log.append(("cleared",))
        self.held.clear()


def batch(*events):
    return SimpleNamespace(ts=0.0, events=list(events))


def setup():
    listener = Listener()
    return listener, VllmKvEvents(listener, BS)


PROMPT = list(range(100, 112))  # three full blocks


def test_a_prompt_stored_in_two_steps_gets_the_routers_hashes():
    listener, ev = setup()
    ours = chained_hashes(PROMPT, BS)
    ev.publish(batch(BlockStored([b"v1", b"v2"], None, PROMPT[:8])))
    ev.publish(batch(BlockStored([b"v3"], b"v2", PROMPT[8:12])))  # the next step: its parent is vLLM's hash
    assert listener.log == [("stored", ours[:2]), ("stored", ours[2:])]
    assert ev.held() == 3 and ev.skipped == 0


def test_removal_maps_back_and_a_hash_cached_twice_goes_with_its_last_block():
    listener, ev = setup()
    ours = chained_hashes(PROMPT[:8], BS)
    ev.publish(batch(BlockStored([b"v1", b"v2"], None, PROMPT[:8])))
    ev.publish(batch(BlockStored([b"v1"], None, PROMPT[:4])))  # a second block under v1 (two requests at once)
    assert listener.log == [("stored", ours)]
    ev.publish(batch(BlockRemoved([b"v2", b"v1"])))
    assert listener.log[-1] == ("removed", [ours[1]]) and listener.held == {ours[0]}
    ev.publish(batch(BlockRemoved([b"v1"])))
    assert listener.log[-1] == ("removed", [ours[0]]) and listener.held == set() and ev.held() == 0


def test_partial_keyed_and_orphan_blocks_are_never_claimed():
    listener, ev = setup()
    ev.publish(batch(
        BlockStored([b"p"], None, PROMPT[:3], block_size=3),           # a partial entry
        BlockStored([b"l"], None, PROMPT[:4], lora_name="adapter"),    # another model's KV
        BlockStored([b"m"], None, PROMPT[:4], extra_keys=[("mm", "x", 0)]),
        BlockStored([b"g"], None, PROMPT[:4], group_idx=1),
        BlockStored([b"o"], b"never-heard", PROMPT[4:8]),              # parent unknown: cannot chain
        BlockRemoved([b"p", b"unknown"]),
    ))
    assert listener.log == [] and ev.skipped == 5 and ev.held() == 0


def test_all_cleared_forgets_everything():
    listener, ev = setup()
    ev.publish(batch(BlockStored([b"v1", b"v2"], None, PROMPT[:8]), AllBlocksCleared()))
    assert listener.log[-1] == ("cleared",) and ev.held() == 0
    ev.publish(batch(BlockStored([b"v3"], b"v2", PROMPT[8:12])))  # its parent went with the clear
    assert ev.skipped == 1 and listener.held == set()
