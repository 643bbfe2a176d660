"""The cost model of disaggregation (prefill_server/cost_model.py, pure) and what feeds it: where a
prompt is computed, why, and the meters (RateMeter, link-busy time)."""

import pytest

from pdserve.prefill_server.cost_model import (LOCAL, REMOTE, CostInputs, decide, link_busy_seconds, local_seconds,
                                               pipelined, remote_seconds)
from pdserve.rate_meter import RateMeter

BLOCK = 64
MB = 1 << 20


def inputs(**kw) -> CostInputs:
    base = dict(prompt_tokens=1000, block_size=BLOCK, num_layers=4, kv_bytes_per_block=MB, prefill_cached_blocks=0,
                decode_cached_blocks=0, prefill_tokens_per_s=10_000.0, link_bytes_per_s=1000.0 * MB)
    base.update(kw)
    return CostInputs(**base)


def test_forced_modes_and_unmeasured():
    assert decide("always", inputs(prompt_tokens=1)) == decide("always", inputs())
    assert decide("always", inputs()).where == REMOTE and decide("always", inputs()).reason == "always"
    assert decide("never", inputs()).where == LOCAL and decide("never", inputs()).reason == "never"
    d = decide("auto", inputs(prefill_tokens_per_s=None))
    assert (d.where, d.reason) == (REMOTE, "unmeasured")
    assert decide("auto", inputs(link_bytes_per_s=None)).reason == "unmeasured"
    with pytest.raises(ValueError, match="unknown disaggregation mode 'sometimes'"):
        decide("sometimes", inputs())


def test_short_prompt_on_an_idle_decode_is_computed_there():
    d = decide("auto", inputs(prompt_tokens=20))
    assert (d.where, d.reason) == (LOCAL, "local_cheaper") and d.local_s < d.remote_s


def test_a_long_prompt_or_a_busy_decode_goes_remote():
    d = decide("auto", inputs(prompt_tokens=2000, decode_running=8))
    assert (d.where, d.reason) == (REMOTE, "remote_cheaper")
    # the same short prompt that was cheaper locally on an idle decode
    assert decide("auto", inputs(prompt_tokens=20, decode_running=0)).where == LOCAL
    assert decide("auto", inputs(prompt_tokens=20, decode_running=30)).where == REMOTE


def test_a_mostly_cached_prompt_is_computed_on_the_decode():
    # 2000 tokens (32 blocks), the decode holds 31: it computes 16 tokens; remote computes all 2000
    busy = dict(prompt_tokens=2000, decode_running=4)
    assert decide("auto", inputs(**busy)).where == REMOTE
    assert decide("auto", inputs(**busy, decode_cached_blocks=31)).where == LOCAL
    # ... unless the prefill holds it too and the link is fast: then both are cheap, remote wins on load
    d = decide("auto", inputs(**busy, decode_cached_blocks=31, prefill_cached_blocks=31))
    assert d.remote_s < local_seconds(inputs(**busy, decode_cached_blocks=31)) and d.where == REMOTE


def test_a_slow_link_and_a_queued_prefill_favour_local():
    base = dict(prompt_tokens=600, decode_running=2)
    assert decide("auto", inputs(**base)).where == REMOTE
    assert decide("auto", inputs(**base, link_bytes_per_s=MB)).where == LOCAL
    assert decide("auto", inputs(**base, prefill_queued_tokens=50_000)).where == LOCAL


def test_the_decode_measured_rate_is_used_when_it_has_one():
    slow_decode = inputs(prompt_tokens=100, decode_tokens_per_s=100.0)
    assert local_seconds(slow_decode) == pytest.approx(1.0)
    assert local_seconds(inputs(prompt_tokens=100)) == pytest.approx(0.01)  # the prefill's rate until then
    assert decide("auto", slow_decode).where == REMOTE


def test_costs_are_what_the_docstring_says():
    c = inputs(prompt_tokens=640, prefill_cached_blocks=2, decode_cached_blocks=4, prefill_queued_tokens=1000,
               decode_running=3)
    compute = (640 - 2 * BLOCK) / 10_000
    transfer = (10 - 4) * MB / (1000 * MB)
    assert remote_seconds(c) == pytest.approx(1000 / 10_000 + max(compute + transfer / 4, transfer + compute / 4))
    assert local_seconds(c) == pytest.approx((640 - 4 * BLOCK) / 10_000 * 4)
    assert pipelined(1.0, 2.0, 4, layerwise=False) == 3.0
    assert pipelined(1.0, 2.0, 4, layerwise=True) == pytest.approx(2.25)


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="decode_cached_blocks must be in \\[0, 16\\)"):
        inputs(decode_cached_blocks=16)
    with pytest.raises(ValueError, match="link_bytes_per_s must be > 0"):
        inputs(link_bytes_per_s=0.0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        inputs(prompt_tokens=0)


def test_link_busy_time_skips_waiting_for_the_forward_pass():
    # layers stored at 0, 1, 2 (compute-bound): each sent in 0.25 s
    assert link_busy_seconds([(0.0, 0.25), (1.0, 1.25), (2.0, 2.25)]) == pytest.approx(0.75)
    # transfer-bound: layers queue behind each other; the link was busy from 0 to 3
    assert link_busy_seconds([(0.0, 1.0), (0.1, 2.0), (0.2, 3.0)]) == pytest.approx(3.0)
    assert link_busy_seconds([]) == 0.0


def test_rate_meter_is_a_windowed_ratio():
    m = RateMeter(window=2)
    assert m.rate() is None
    m.add(100, 1.0)
    m.add(0, 1.0)  # ignored: not a measurement
    m.add(300, 1.0)
    assert m.rate() == pytest.approx(200.0) and len(m) == 2
    m.add(1000, 2.0)  # the first sample leaves the window
    assert m.rate() == pytest.approx(1300 / 3)
    with pytest.raises(ValueError):
        RateMeter(window=0)
