"""Frontend.stream: one Piece per generated token (its text possibly ""), then a finish Piece
with no token carrying the text held back to the end; the joined text never changes.

The node is a stand-in that yields the Deltas a decode would send (several tokens in one
Delta, as happens when the relay lags); the tokenizer is the engine's byte tokenizer.
"""

import asyncio

import pytest

from pdserve.engine import SamplingParams
from pdserve.engine.tokenizer import ByteTokenizer
from pdserve.prefill_server.admission_queue import note_waited_in_line
from pdserve.prefill_server.decode_session import Delta
from pdserve.prefill_server.frontend import Frontend, RequestTimedOut

TOK = ByteTokenizer()


class ScriptedNode:
    """Yields the given Deltas; records whether its generator was closed early."""

    def __init__(self, deltas):
        self.deltas, self.closed_early = deltas, False

    async def generate(self, request_id, prompt_ids, sp, deadline=None, slo=None, produced=()):
        sent = 0
        try:
            for delta in self.deltas:
                yield delta
                sent += 1
        finally:
            self.closed_early = sent < len(self.deltas)


def _run(deltas, stop=None):
    node = ScriptedNode(deltas)
    fe = Frontend(node, TOK, SamplingParams, "tiny", 2048, vocab_size=TOK.vocab_size)

    async def collect():
        return [p async for p in fe.stream("r", [256, 1], SamplingParams(max_tokens=64, stop=stop or []))]

    return asyncio.run(collect()), node


def _check_shape(pieces):
    *tokens, last = pieces
    assert all(len(p.token_ids) == 1 and not p.finished for p in tokens)
    assert last.finished and last.token_ids == [] and last.finish_reason


def test_one_piece_per_token_with_multibyte_characters():
    text = "aé€😀b"  # 1, 2, 3 and 4 UTF-8 bytes: one token per byte
    ids = list(text.encode())
    deltas = [Delta(ids[:4]), Delta(ids[4:9]), Delta(ids[9:]), Delta([], True, "length")]
    pieces, _ = _run(deltas)
    _check_shape(pieces)
    assert [p.token_ids[0] for p in pieces[:-1]] == ids  # every token, in order
    assert [p.text for p in pieces[:-1]] == ["a", "", "é", "", "", "€", "", "", "", "😀", "b"]
    assert "".join(p.text for p in pieces) == text
    assert pieces[-1].finish_reason == "length" and pieces[-1].text == ""


def test_special_tokens_are_events_with_empty_text():
    ids = [ord("x"), TOK.EOS, TOK.BOS, ord("y")]  # ignore_eos: EOS is generated text-less
    pieces, _ = _run([Delta(ids), Delta([], True, "length")])
    _check_shape(pieces)
    assert [p.text for p in pieces[:-1]] == ["x", "", "", "y"]


def test_stop_string_held_back_then_cut():
    ids = list(b"hello world")
    pieces, node = _run([Delta(ids[:3]), Delta(ids[3:8]), Delta(ids[8:])], stop=["lo w"])
    _check_shape(pieces)
    # tokens up to the one completing "lo w" (the 'w', index 6); none after it
    assert [p.token_ids[0] for p in pieces[:-1]] == ids[:7]
    assert [p.text for p in pieces[:-1]] == ["h", "e", "", "l", "", "", ""]  # each "l" might begin "lo w"
    assert "".join(p.text for p in pieces) == "hel"
    assert pieces[-1].finish_reason == "stop"
    assert node.closed_early  # the node's stream is closed (the Session cancelled) at the stop


def test_held_back_text_at_the_end_goes_with_the_finish():
    ids = list(b"abx")  # "x" could begin the stop string "xyz": held back until the end
    pieces, _ = _run([Delta(ids), Delta([], True, "length")], stop=["xyz"])
    _check_shape(pieces)
    assert [p.text for p in pieces[:-1]] == ["a", "b", ""]
    assert pieces[-1].text == "x"


def test_incomplete_character_at_the_end_is_flushed():
    ids = list("é".encode())[:1]  # the first byte of a two-byte character, then the request ends
    pieces, _ = _run([Delta(ids, True, "length")])
    _check_shape(pieces)
    assert pieces[0].text == "" and pieces[-1].text == "\ufffd"


def test_a_request_with_no_token_is_only_the_finish():
    pieces, _ = _run([Delta([], True, "stop")])  # e.g. the first token was a stop token
    assert len(pieces) == 1 and pieces[0].finished and pieces[0].token_ids == []


class QueuedNode(ScriptedNode):
    """Waits in line forever; when its generator is cancelled there, its cancellation says how long it
    waited (as PrefillNode's conductor)."""

    async def generate(self, request_id, prompt_ids, sp, deadline=None, slo=None, produced=()):
        try:
            await asyncio.sleep(3600)
            yield Delta([], True, "stop")
        except asyncio.CancelledError as cancel:
            note_waited_in_line(cancel, 0.2)
            raise


def test_a_deadline_that_wins_the_race_with_the_queue_still_names_the_queue():
    # the queue gives up just before the deadline with its own message; on a stalled event loop the
    # Frontend's deadline can fire first: its 504 then names the admission queue all the same
    node = QueuedNode([])
    fe = Frontend(node, TOK, SamplingParams, "tiny", 2048, vocab_size=TOK.vocab_size)

    async def collect():
        return [p async for p in fe.stream("r", [256, 1], SamplingParams(max_tokens=4), timeout_s=0.05)]

    with pytest.raises(RequestTimedOut, match="waited 0.2s in the admission queue"):
        asyncio.run(collect())


def test_the_first_piece_carries_the_first_attempts_prefix_hit():
    # a resumed attempt's Delta (after a decode failed mid-stream) says its own hit: not the client's
    ids = list(b"abc")
    pieces, _ = _run([Delta(ids[:2], cached_tokens=32), Delta(ids[2:], cached_tokens=0), Delta([], True, "length")])
    assert [p.cached_tokens for p in pieces] == [32, None, None, None]
    # no token before the finish (a stop token first): the finish Piece carries it
    pieces, _ = _run([Delta([], True, "stop", cached_tokens=16)])
    assert [p.cached_tokens for p in pieces] == [16]
    # an attempt that did not say (no prefix cache involved): nothing is claimed
    pieces, _ = _run([Delta(ids), Delta([], True, "length")])
    assert {p.cached_tokens for p in pieces} == {None}
