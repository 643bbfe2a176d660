"""The prefill's SLO queue is told how much of a prompt its prefix cache holds (Frontend._arrive):
the qlm policy and early rejection estimate a prompt's prefill by the tokens to compute, so a later
turn of a conversation is not taken for a long prompt. With fifo and no early rejection the
estimate decides nothing and the prompt is not hashed."""

import asyncio

from pdserve.engine import SamplingParams, chained_hashes
from pdserve.engine.tokenizer import ByteTokenizer
from pdserve.prefill_server.decode_session import Delta
from pdserve.prefill_server.disaggregator import Disaggregator
from pdserve.prefill_server.frontend import Frontend
from pdserve.prefill_server.picker import DecodePicker
from pdserve.slo import GlobalQueue, parse

BS = 16
TOK = ByteTokenizer()


class Node:
    """One Delta per request; its prefix cache holds the hashes in ``held`` (the KV events' mirror)."""

    block_size = BS

    def __init__(self, held: set[int]):
        self.looked_up = 0

        def leading(hashes):
            self.looked_up += 1
            n = 0
            while n < len(hashes) and hashes[n] in held:
                n += 1
            return n

        self.disaggregator = Disaggregator("always", picker=DecodePicker(), block_size=BS, num_layers=2,
                                           kv_bytes_per_block=1024, held_prefix=leading)

    async def generate(self, request_id, prompt_ids, sp, deadline=None, slo=None, produced=()):
        yield Delta([65], True, "length")


def _serve(policy: str, classes: dict, prompt: list[int], held_tokens: int):
    held = set(chained_hashes(prompt[:held_tokens], BS))
    node, q = Node(held), GlobalQueue(parse(classes), policy)
    fe = Frontend(node, TOK, SamplingParams, "tiny", 2048, vocab_size=TOK.vocab_size, slo=q)

    async def run():
        return [p async for p in fe.stream("r1", prompt, SamplingParams(max_tokens=1))]

    asyncio.run(run())
    return node, q.account.records[-1]


PROMPT = [1 + i % 200 for i in range(20 * BS + 5)]  # 20 full blocks and a partial one


def test_qlm_learns_the_cached_prefix_of_the_prompt():
    node, rec = _serve("qlm", {"ttftMs": 2000}, PROMPT, held_tokens=12 * BS)
    assert node.looked_up == 1
    assert rec["inputs"]["cached_tokens"] == 12 * BS


def test_a_prompt_held_whole_still_computes_its_last_block():
    node, rec = _serve("qlm", {"ttftMs": 2000}, PROMPT[: 20 * BS], held_tokens=20 * BS)
    assert rec["inputs"]["cached_tokens"] == 19 * BS  # the block of the last token is always computed


def test_early_rejection_looks_it_up_under_fifo_too():
    node, rec = _serve("fifo", {"ttftMs": 2000, "earlyReject": True}, PROMPT, held_tokens=4 * BS)
    assert node.looked_up == 1 and rec["inputs"]["cached_tokens"] == 4 * BS


def test_fifo_without_early_rejection_does_not_hash_the_prompt():
    node, rec = _serve("fifo", {"ttftMs": 2000}, PROMPT, held_tokens=12 * BS)
    assert node.looked_up == 0 and rec["inputs"]["cached_tokens"] == 0
