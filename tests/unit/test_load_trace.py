"""The load trace of `pdserve bench experiment autoscale`: its shape and its Poisson arrivals."""

import pytest

from pdserve.bench.experiments.load_trace import LoadTrace


def test_the_rate_follows_quiet_burst_plateau_ramp_quiet():
    tr = LoadTrace(rate=1.0, burst=4.0, quiet_s=10, plateau_s=20, ramp_s=10, tail_s=10)
    assert [tr.rate_at(t) for t in (0, 9.9, 10, 29.9)] == [1, 1, 4, 4]
    assert tr.rate_at(35) == pytest.approx(2.5) and tr.rate_at(40) == 1 and tr.rate_at(50) == 0
    assert tr.duration_s == 50 and [p[0] for p in tr.phases()] == ["quiet", "burst + plateau", "ramp down", "quiet"]


def test_arrivals_are_reproducible_and_as_dense_as_the_rate():
    tr = LoadTrace(rate=2.0, burst=4.0, quiet_s=100, plateau_s=100, ramp_s=0, tail_s=0)
    a = tr.arrivals(seed=1)
    assert a == tr.arrivals(seed=1) and a != tr.arrivals(seed=2)
    quiet, burst = sum(t < 100 for t in a), sum(t >= 100 for t in a)
    assert 150 < quiet < 250 and 700 < burst < 900     # 200 and 800 expected
    assert a == sorted(a) and a[-1] < tr.duration_s


def test_bad_traces_are_refused():
    with pytest.raises(ValueError, match="burst"):
        LoadTrace(burst=0.5)
    with pytest.raises(ValueError, match="rate"):
        LoadTrace(rate=0)
