"""aclose_fully: a request's teardown runs to its end even when the closing task is cancelled
(aiohttp cancels a handler when the client disconnects right after [DONE])."""

import asyncio

import pytest

from pdserve.prefill_server.closing import aclose_fully


def _request_stream(log: list[str], release: asyncio.Event):
    async def stream():
        try:
            yield "token"
        finally:
            log.append("teardown started")
            await release.wait()  # e.g. half-closing the Session, releasing engine blocks
            log.append("teardown finished")
    return stream()


@pytest.mark.parametrize("close", ["aclose", "aclose_fully"])
def test_a_cancel_during_teardown(close):
    async def scenario():
        log, release = [], asyncio.Event()
        agen = _request_stream(log, release)
        assert await agen.__anext__() == "token"

        async def handler():
            await (agen.aclose() if close == "aclose" else aclose_fully(agen))

        task = asyncio.create_task(handler())
        while "teardown started" not in log:
            await asyncio.sleep(0)
        task.cancel()  # the client went away while the teardown awaits
        await asyncio.sleep(0)
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)
        return log

    log = asyncio.run(scenario())
    if close == "aclose":  # the bug: the rest of the teardown never ran
        assert log == ["teardown started"]
    else:
        assert log == ["teardown started", "teardown finished"]
