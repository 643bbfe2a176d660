"""The Disaggregator (prefill_server/disaggregator.py): the cost model's inputs from measurements
and load reports, its two rules (unmeasured until MIN_SAMPLES, remeasure after a local streak),
the decision metric, the prefill's own cached prefix and queue."""

import pytest

from pdserve.engine import chained_hashes
from pdserve.metrics import ServerMetrics
from pdserve.prefill_server.disaggregator import MIN_SAMPLES, REMEASURE_EVERY, Disaggregator
from pdserve.prefill_server.picker import DecodeLoad, DecodePicker

BS = 16
KB = 1024


def _disaggregator(mode="auto", running=0, **kw):
    picker = DecodePicker()
    picker.update("d", DecodeLoad(free_blocks=100, free_bytes=100 * KB, running=running))
    m = ServerMetrics(role="prefill")
    return Disaggregator(mode, picker=picker, block_size=BS, num_layers=4, kv_bytes_per_block=16 * KB, metrics=m,
                         **kw), m


def _measure(d, n=MIN_SAMPLES):
    for i in range(n):  # 2 ms per pass + 10k tokens/s; 1 ms per transfer + 100 MB/s
        tokens = 64 * (i + 1)
        d.record_prefill(tokens, 0.002 + tokens / 10_000)
        d.record_transfer(tokens * KB, 0.001 + tokens * KB / (100 * 1024 * KB))


def _count(m, decision, reason):
    return m.registry.get_sample_value("pdserve_disaggregation_decisions_total", {
        "role": "prefill", "pool": "default", "inference_service": "local", "decision": decision, "reason": reason,
    }) or 0


def test_unmeasured_until_enough_samples_then_by_cost():
    d, m = _disaggregator()
    prompt = list(range(1, 41))
    _measure(d, MIN_SAMPLES - 1)
    assert (d.decide("d", "r1", prompt, 0).reason, d.decide("d", "r2", prompt, 0).where) == ("unmeasured", "remote")
    _measure(d, 1)
    decision = d.decide("d", "r3", prompt, 1)  # an idle decode, a short prompt: cheaper there
    assert (decision.where, decision.reason) == ("local", "local_cheaper")
    assert _count(m, "remote", "unmeasured") == 2 and _count(m, "local", "local_cheaper") == 1
    assert d.state()["prefill_compute"]["fixed_s"] == pytest.approx(0.002)
    assert d.state()["link"]["per_second"] == pytest.approx(100 * 1024 * KB)


def test_a_busy_decode_gets_remote_and_its_sessions_count():
    d, _ = _disaggregator(running=12)
    _measure(d)
    prompt = list(range(1, 401))
    assert d.decide("d", "r", prompt, 0).reason == "remote_cheaper"
    idle, _ = _disaggregator(running=0)
    _measure(idle)
    assert idle.decide("d", "r", prompt, 0).where == "local"
    for _ in range(12):  # sessions this prefill opened there since its last load report
        idle.picker.note_allocation("d", 1, KB)
    assert idle.decide("d", "r", prompt, 0).where == "remote"


def test_a_long_local_streak_is_broken_by_one_remote_to_measure_again():
    d, m = _disaggregator()
    _measure(d)
    prompt = list(range(1, 41))
    wheres = [d.decide("d", f"r{i}", prompt, 1).where for i in range(REMEASURE_EVERY + 2)]
    assert wheres == ["local"] * REMEASURE_EVERY + ["remote", "local"]
    assert _count(m, "remote", "remeasure") == 1


def test_forced_modes_ignore_costs():
    always, m = _disaggregator("always")
    assert always.decide("d", "r", [1, 2, 3], 0).reason == "always" and _count(m, "remote", "always") == 1
    never, m = _disaggregator("never")
    assert never.decide("d", "r", [1, 2, 3], 0).where == "local" and _count(m, "local", "never") == 1
    with pytest.raises(ValueError, match="unknown disaggregation mode"):
        _disaggregator("maybe")


def test_own_cached_prefix_and_queue():
    prompt = list(range(1, 5 * BS + 1))  # 5 full blocks: at most 4 count (the last token is computed)
    held = set(chained_hashes(prompt, BS)[:3])
    d, _ = _disaggregator(held_prefix=lambda hashes: next((i for i, h in enumerate(hashes) if h not in held),
                                                          len(hashes)))
    assert d.prefill_cached_blocks(prompt) == 3
    held |= set(chained_hashes(prompt, BS))
    assert d.prefill_cached_blocks(prompt) == 4
    with d.computing(100):
        with d.computing(50):
            assert d.queued_tokens == 150
    assert d.queued_tokens == 0
    always, _ = _disaggregator("always", held_prefix=lambda hashes: len(hashes))
    assert always.prefill_cached_blocks(prompt) == 0  # not looked at: the costs are not used


def test_prompt_logprobs_are_always_remote():
    """Only this prefill's forward pass over the whole prompt gives a request its prompt's logprobs:
    remote in every mode, whatever the costs say (an idle decode holding most of the prompt)."""
    prompt = list(range(1, 41))
    for mode in ("auto", "never", "always"):
        d, m = _disaggregator(mode)
        _measure(d)
        decision = d.decide("d", "r", prompt, 2, prompt_logprobs=True)
        assert (decision.where, decision.reason) == ("remote", "prompt_logprobs"), mode
        assert _count(m, "remote", "prompt_logprobs") == 1
    assert d.local_streak == 0
