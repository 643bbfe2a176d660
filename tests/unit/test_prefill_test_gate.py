"""The prefill's test gate (``PDSERVE_TEST_GATE_AFTER_ALLOCATION``, prefill_server/decode_session.py)
as tests/harness/gates.py drives it: a held request is announced, goes on when the gate opens, and
withdraws its announcement also when it is cancelled."""

import asyncio

from harness.gates import Gate
from pdserve.prefill_server import decode_session

HANG_GUARD_S = 10.0  # only a hang guard: each wait below ends within a few polls


async def _until(predicate):
    async with asyncio.timeout(HANG_GUARD_S):
        while not predicate():
            await asyncio.sleep(0.02)


def test_held_until_opened_then_passes_at_once(tmp_path, monkeypatch):
    gate = Gate(tmp_path)
    monkeypatch.setattr(decode_session, "TEST_GATE_DIR", str(tmp_path))

    async def scenario():
        held = asyncio.ensure_future(decode_session._wait_at_test_gate("req-1"))
        await _until(lambda: gate.held() == ["req-1"])
        assert not held.done()
        gate.open()
        await asyncio.wait_for(held, HANG_GUARD_S)
        assert gate.held() == []
        await asyncio.wait_for(decode_session._wait_at_test_gate("req-2"), HANG_GUARD_S)  # open: not held
        assert gate.held() == []

    asyncio.run(scenario())


def test_a_cancelled_request_leaves_the_gate(tmp_path, monkeypatch):
    gate = Gate(tmp_path)
    monkeypatch.setattr(decode_session, "TEST_GATE_DIR", str(tmp_path))

    async def scenario():
        held = asyncio.ensure_future(decode_session._wait_at_test_gate("a/b"))  # no path separator in the file name
        await _until(lambda: gate.held() == ["a_b"])
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        assert held.cancelled() and gate.held() == []

    asyncio.run(scenario())


def test_gate_env_names_the_hook(tmp_path):
    assert Gate(tmp_path).env == {"PDSERVE_TEST_GATE_AFTER_ALLOCATION": str(tmp_path)}
