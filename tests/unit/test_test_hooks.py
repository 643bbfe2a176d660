"""The servers' test gates (pdserve/test_hooks.py) as tests/harness/gates.py and decode_gate.py drive
them: a held request is announced, goes on when the gate opens, and withdraws its announcement also
when it is cancelled; each server reads its own variable (the prefill's PDSERVE_TEST_GATE_AFTER_ALLOCATION,
the decode's PDSERVE_TEST_DECODE_GATE)."""

import asyncio

import pytest

from harness.conditions import until
from harness.decode_gate import DecodeGate
from harness.gates import Gate
from pdserve.test_hooks import hold_thread_at_gate, wait_at_gate

HANG_GUARD_S = 10.0  # only a hang guard: each wait below ends within a few polls


@pytest.mark.parametrize("kind", [Gate, DecodeGate])
def test_held_until_opened_then_passes_at_once(tmp_path, kind):
    gate = kind(tmp_path)

    async def scenario():
        held = asyncio.ensure_future(wait_at_gate(str(tmp_path), "req-1"))
        await until(lambda: gate.held() == ["req-1"], "req-1 held", HANG_GUARD_S)
        assert not held.done()
        gate.open()
        await asyncio.wait_for(held, HANG_GUARD_S)
        assert gate.held() == []
        await asyncio.wait_for(wait_at_gate(str(tmp_path), "req-2"), HANG_GUARD_S)  # open: not held
        assert gate.held() == []

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", [Gate, DecodeGate])
def test_a_cancelled_request_leaves_the_gate(tmp_path, kind):
    gate = kind(tmp_path)

    async def scenario():
        held = asyncio.ensure_future(wait_at_gate(str(tmp_path), "a/b"))  # no path separator in the file name
        await until(lambda: gate.held() == ["a_b"], "a_b held", HANG_GUARD_S)
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        assert held.cancelled() and gate.held() == []

    asyncio.run(scenario())


def test_a_thread_is_held_until_the_gate_opens(tmp_path):
    """The engine thread's form (the prefill's PDSERVE_TEST_LAYER_GATE): it blocks, announced, until open."""
    import threading

    from harness.conditions import wait_until

    gate = Gate(tmp_path)
    thread = threading.Thread(target=hold_thread_at_gate, args=(str(tmp_path), "req-1"), daemon=True)
    thread.start()
    wait_until(lambda: gate.held() == ["req-1"], "req-1 held", HANG_GUARD_S)
    assert thread.is_alive()
    gate.open()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive() and gate.held() == []


def test_gate_env_names_each_servers_hook(tmp_path):
    assert Gate(tmp_path).env == {"PDSERVE_TEST_GATE_AFTER_ALLOCATION": str(tmp_path)}
    assert DecodeGate(tmp_path).env == {"PDSERVE_TEST_DECODE_GATE": str(tmp_path)}


def test_hooks_are_read_when_used_not_at_import(monkeypatch, tmp_path):
    from pdserve import test_hooks

    for env in (test_hooks.PREFILL_GATE_ENV, test_hooks.DECODE_GATE_ENV, test_hooks.KVPOOL_GATE_ENV,
                test_hooks.LAYER_GATE_ENV):
        monkeypatch.delenv(env, raising=False)
        assert test_hooks.gate_dir(env) == ""
        monkeypatch.setenv(env, str(tmp_path))
        assert test_hooks.gate_dir(env) == str(tmp_path)
    monkeypatch.delenv(test_hooks.CORRUPT_KV_ENV, raising=False)
    assert test_hooks.corrupt_kv() == 0
    monkeypatch.setenv(test_hooks.CORRUPT_KV_ENV, "2")
    assert test_hooks.corrupt_kv() == 2
    monkeypatch.setenv(test_hooks.CORRUPT_KV_ENV, "two")
    with pytest.raises(ValueError, match="PDSERVE_TEST_CORRUPT_KV='two': expected a number"):
        test_hooks.corrupt_kv()


def test_no_production_module_reads_a_test_hook_from_the_environment():
    """Every PDSERVE_TEST_* variable is named in pdserve/test_hooks.py alone (tests name them to set them)."""
    import pathlib

    repo = pathlib.Path(__file__).resolve().parents[2]
    readers = [str(p.relative_to(repo)) for folder in ("engine", "cachestore", "prefill_server", "decode_server",
                                                       "router", "kvpool", "pdserve", "localcluster", "operator",
                                                       "batch")
               for p in (repo / folder).rglob("*.py")
               if "PDSERVE_TEST_" in p.read_text() and p.name != "test_hooks.py"]
    assert readers == [], readers


def test_gates_are_read_once_at_start_not_on_the_request_path(monkeypatch, tmp_path):
    """The request paths hold a TestGates read when the server is wired: changing the environment afterwards
    changes nothing (before, each request looked the variable up)."""
    from pdserve import test_hooks
    from pdserve.test_hooks import NO_GATES, TestGates

    monkeypatch.setenv(test_hooks.DECODE_GATE_ENV, str(tmp_path))
    monkeypatch.setenv(test_hooks.LAYER_GATE_ENV, str(tmp_path / "layer"))
    gates = TestGates.from_environment()
    monkeypatch.delenv(test_hooks.DECODE_GATE_ENV)
    assert gates.decode == str(tmp_path) and gates.layer == str(tmp_path / "layer")
    assert gates.prefill_after_allocation == gates.decode_finish == gates.kvpool == ""
    assert NO_GATES == TestGates() and not any((NO_GATES.decode, NO_GATES.layer, NO_GATES.kvpool))
    import inspect

    from pdserve.decode_server import session
    from pdserve.prefill_server import decode_session
    from pdserve.kvpool import pooled

    for module in (session, decode_session, pooled):  # no environment read left on these request paths
        assert "gate_dir(" not in inspect.getsource(module) and "os.environ" not in inspect.getsource(module)
