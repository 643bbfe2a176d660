"""The decode's test gate (``PDSERVE_TEST_DECODE_GATE``, decode_server/session.py) as
tests/harness/decode_gate.py drives it: a held request is announced, goes on when the gate opens,
and withdraws its announcement also when it is cancelled (prefill went away)."""

import asyncio

from harness.conditions import until
from harness.decode_gate import DecodeGate
from pdserve.decode_server import session

HANG_GUARD_S = 10.0  # only a hang guard: each wait below ends within a few polls


def test_held_until_opened_then_passes_at_once(tmp_path, monkeypatch):
    gate = DecodeGate(tmp_path)
    monkeypatch.setattr(session, "TEST_GATE_DIR", str(tmp_path))

    async def scenario():
        held = asyncio.ensure_future(session._wait_at_test_gate("req-1"))
        await until(lambda: gate.held() == ["req-1"], "req-1 held", HANG_GUARD_S)
        assert not held.done()
        gate.open()
        await asyncio.wait_for(held, HANG_GUARD_S)
        assert gate.held() == []
        await asyncio.wait_for(session._wait_at_test_gate("req-2"), HANG_GUARD_S)  # open: not held
        assert gate.held() == []

    asyncio.run(scenario())


def test_a_cancelled_request_leaves_the_gate(tmp_path, monkeypatch):
    gate = DecodeGate(tmp_path)
    monkeypatch.setattr(session, "TEST_GATE_DIR", str(tmp_path))

    async def scenario():
        held = asyncio.ensure_future(session._wait_at_test_gate("a/b"))  # no path separator in the file name
        await until(lambda: gate.held() == ["a_b"], "a_b held", HANG_GUARD_S)
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        assert held.cancelled() and gate.held() == []

    asyncio.run(scenario())


def test_gate_env_names_the_hook(tmp_path):
    assert DecodeGate(tmp_path).env == {"PDSERVE_TEST_DECODE_GATE": str(tmp_path)}
