"""The cost model of disaggregation (prefill_server/cost_model.py, pure) and what feeds it: where a
prompt is computed, why, and the meters (RateMeter, link-busy time)."""

import pytest

from pdserve.prefill_server.cost_model import (LOCAL, REMOTE, CostInputs, decide, link_busy_seconds, local_seconds,
                                               pipelined, remote_seconds)
from pdserve.rate_meter import CostMeter, LinearCost, RateMeter

BLOCK = 64
MB = 1 << 20


def inputs(**kw) -> CostInputs:
    base = dict(prompt_tokens=1000, block_size=BLOCK, num_layers=4, kv_bytes_per_block=MB, prefill_cached_blocks=0,
                decode_cached_blocks=0, prefill_compute=LinearCost(0.0, 1 / 10_000),
                link=LinearCost(0.0, 1 / (1000 * MB)))
    base.update(kw)
    return CostInputs(**base)


def test_forced_modes_and_unmeasured():
    assert decide("always", inputs(prompt_tokens=1)) == decide("always", inputs())
    assert decide("always", inputs()).where == REMOTE and decide("always", inputs()).reason == "always"
    assert decide("never", inputs()).where == LOCAL and decide("never", inputs()).reason == "never"
    d = decide("auto", inputs(prefill_compute=None))
    assert (d.where, d.reason) == (REMOTE, "unmeasured")
    assert decide("auto", inputs(link=None)).reason == "unmeasured"
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
    assert decide("auto", inputs(**base, link=LinearCost(0.0, 1 / MB))).where == LOCAL
    # a per-transfer latency counts too, however fast the bytes go
    assert decide("auto", inputs(**base, link=LinearCost(0.2, 1 / (1000 * MB)))).where == LOCAL
    assert decide("auto", inputs(**base, prefill_queued_tokens=50_000)).where == LOCAL


def test_the_decode_measured_rate_is_used_when_it_has_one():
    slow_decode = inputs(prompt_tokens=100, decode_tokens_per_s=100.0)
    assert local_seconds(slow_decode) == pytest.approx(1.0)
    assert local_seconds(inputs(prompt_tokens=100)) == pytest.approx(0.01)  # the prefill's rate until then
    assert decide("auto", slow_decode).where == REMOTE


def test_costs_are_what_the_docstring_says():
    c = inputs(prompt_tokens=640, prefill_cached_blocks=2, decode_cached_blocks=4, prefill_queued_tokens=1000,
               decode_running=3, link=LinearCost(0.002, 1 / (1000 * MB)))
    compute = (640 - 2 * BLOCK) / 10_000
    transfer = 0.002 + (10 - 4) * MB / (1000 * MB)
    assert remote_seconds(c) == pytest.approx(1000 / 10_000 + max(compute + transfer / 4, transfer + compute / 4))
    assert local_seconds(c) == pytest.approx((640 - 4 * BLOCK) / 10_000 * 4)
    assert pipelined(1.0, 2.0, 4, layerwise=False) == 3.0
    assert pipelined(1.0, 2.0, 4, layerwise=True) == pytest.approx(2.25)


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="decode_cached_blocks must be in \\[0, 16\\)"):
        inputs(decode_cached_blocks=16)
    with pytest.raises(ValueError, match="link must have fixed_s >= 0 and per_unit_s > 0"):
        inputs(link=LinearCost(-1.0, 1.0))
    with pytest.raises(ValueError, match="decode_tokens_per_s must be > 0"):
        inputs(decode_tokens_per_s=0.0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        inputs(prompt_tokens=0)


def test_link_busy_time_skips_waiting_for_the_forward_pass():
    # layers stored at 0, 1, 2 (compute-bound): each sent in 0.25 s
    assert link_busy_seconds([(0.0, 0.25), (1.0, 1.25), (2.0, 2.25)]) == pytest.approx(0.75)
    # transfer-bound: layers queue behind each other; the link was busy from 0 to 3
    assert link_busy_seconds([(0.0, 1.0), (0.1, 2.0), (0.2, 3.0)]) == pytest.approx(3.0)
    assert link_busy_seconds([]) == 0.0


def test_rate_meter_is_a_windowed_median():
    m = RateMeter(window=3)
    assert m.rate() is None
    m.add(100, 1.0)
    m.add(0, 1.0)  # ignored: not a measurement
    m.add(300, 1.0)
    assert m.rate() == pytest.approx(200.0) and len(m) == 2
    m.add(10, 1.0)  # an outlier (a warm-up) does not drag the rate down
    assert m.rate() == pytest.approx(100.0)
    m.add(400, 1.0)  # the first sample leaves the window: 300, 10, 400
    assert m.rate() == pytest.approx(300.0)
    with pytest.raises(ValueError):
        RateMeter(window=0)


def test_cost_meter_separates_a_fixed_time_from_a_throughput():
    m = CostMeter()
    assert m.fit() is None
    for n in (1, 2, 4, 8):  # 1 ms per transfer plus 1 ms per MB
        m.add(n * MB, 0.001 + n * 0.001)
    fit = m.fit()
    assert fit.fixed_s == pytest.approx(0.001) and fit.rate == pytest.approx(1000 * MB)
    assert fit.seconds(16 * MB) == pytest.approx(0.017)
    same = CostMeter()  # amounts too alike to separate: the plain ratio
    for _ in range(5):
        same.add(MB, 0.002)
    assert same.fit().fixed_s == 0.0 and same.fit().per_unit_s == pytest.approx(0.002 / MB)
    noisy = CostMeter()  # bigger was not slower: no negative throughput, the median ratio instead
    for n, s in ((1, 0.004), (2, 0.003), (4, 0.002)):
        noisy.add(n, s)
    assert noisy.fit().fixed_s == 0.0 and noisy.fit().per_unit_s == pytest.approx(0.0015)
    warm = CostMeter()  # one warm-up pass 1000x slower than the rest changes nothing
    warm.add(4 * MB, 1.0)
    for n in (1, 2, 4, 8, 1, 2):
        warm.add(n * MB, 0.001 + n * 0.001)
    assert warm.fit().fixed_s == pytest.approx(0.001) and warm.fit().rate == pytest.approx(1000 * MB)
