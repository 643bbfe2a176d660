"""Why a decode session ended is typed (decode_server/session_stream.py's ``End``): each wait on
prefill raises ``SessionEnded`` with its ``End``, which says whether prefill is told and the
(outcome, reason) labels the requests counter counts it under; no message text is matched."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.decode_server.session_metrics import SessionMetrics
from pdserve.decode_server.session_stream import End, SessionEnded, SessionStream


class FakeContext:
    """A ServicerContext whose writes never complete (a prefill that stopped reading) when ``stuck``,
    and whose reads return ``messages`` then wait (or EOF when ``eof``)."""

    def __init__(self, stuck: bool = False, eof: bool = False):
        self.stuck, self.eof, self.written = stuck, eof, []

    async def write(self, message) -> None:
        if self.stuck:
            await asyncio.Event().wait()
        self.written.append(message)

    async def read(self):
        if self.eof:
            return grpc.aio.EOF
        await asyncio.Event().wait()


def test_labels_are_the_counters_values_and_only_live_prefills_are_told():
    assert End.TIMED_OUT.labels == ("error", "timeout")
    assert End.FAILED.labels == ("error", "error")
    assert End.PREFILL_GONE.labels == End.PREFILL_STUCK.labels == ("cancelled", "prefill_gone")
    assert [e for e in End if e.notify] == [End.FAILED, End.TIMED_OUT]
    assert SessionEnded("anything").end is End.FAILED and SessionEnded("anything").notify


async def _ended(stream_coro) -> SessionEnded:
    with pytest.raises(SessionEnded) as info:
        await stream_coro
    return info.value


def test_a_wait_that_times_out_ends_timed_out():
    async def go():
        stream = SessionStream(FakeContext(), SessionMetrics(None, 1), session_timeout_s=5.0)
        return await _ended(stream.until_peer_gone_or(asyncio.Event().wait(), 0.01, "the first token"))

    exc = asyncio.run(go())
    assert exc.end is End.TIMED_OUT and exc.notify
    assert "the first token" in exc.reason


def test_prefill_closing_the_stream_ends_prefill_gone_whatever_its_words():
    async def go():
        stream = SessionStream(FakeContext(eof=True), SessionMetrics(None, 1), session_timeout_s=5.0)
        reader = asyncio.ensure_future(stream.read_rest())
        try:
            return await _ended(stream.until_peer_gone_or(asyncio.Event().wait(), 5.0, "the first token"))
        finally:
            reader.cancel()

    exc = asyncio.run(go())
    assert exc.end is End.PREFILL_GONE and not exc.notify
    assert exc.reason == "prefill closed the session"


def test_a_write_prefill_never_takes_ends_prefill_stuck_though_its_words_say_timed_out():
    async def go():
        stream = SessionStream(FakeContext(stuck=True), SessionMetrics(None, 1), session_timeout_s=0.01)
        return await _ended(stream.write())

    exc = asyncio.run(go())
    assert "timed out" in exc.reason  # the words; the counter's labels come from the End alone
    assert exc.end is End.PREFILL_STUCK and exc.end.labels == ("cancelled", "prefill_gone") and not exc.notify


def test_a_session_cancelled_while_its_finish_is_written_ended_ok_not_prefill_gone():
    """The prefill closes the session as soon as it reads the Finish; that cancels the decode's
    handler, sometimes before its write of the Finish has returned (CI saw a completed request counted
    as cancelled/prefill_gone under load). Cancelled before the Finish: prefill gone."""
    async def go():
        stream = SessionStream(FakeContext(stuck=True), SessionMetrics(None, 1), session_timeout_s=60.0)
        before = stream.cancelled_labels()
        writing = asyncio.ensure_future(stream.write_finish("length", 3))
        await asyncio.sleep(0)  # the write is now awaited
        writing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writing
        return before, stream.cancelled_labels()

    before, after = asyncio.run(go())
    assert before == End.PREFILL_GONE.labels == ("cancelled", "prefill_gone")
    assert after == ("ok", "length")
