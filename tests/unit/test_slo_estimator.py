"""The waiting-time estimator (pdserve.slo.estimator): what it learns online, and its plan of
a queue against QLM's equations 1-4."""

import math

import pytest

from pdserve.slo.estimator import Estimator, Job, simulate
from pdserve.slo.measures import LineFit, OutputLengths, WindowRate


def test_the_prefill_line_is_learned_from_observations():
    fit = LineFit(decay=1.0)
    assert fit.predict(100) is None
    fit.add(100, 0.05)
    assert fit.predict(200) == pytest.approx(0.10)  # one length seen: proportional
    for n in (50, 300, 700):
        fit.add(n, 0.01 + 0.0004 * n)
    fit.add(100, 0.01 + 0.04)
    assert fit.predict(1000) == pytest.approx(0.01 + 0.4, rel=0.05)


def test_a_slope_from_noise_is_never_negative():
    fit = LineFit(decay=1.0)
    fit.add(100, 0.2)
    fit.add(200, 0.1)
    assert fit.predict(10_000) == pytest.approx(0.15)


def test_output_lengths_per_class_capped_and_conditional():
    lengths = OutputLengths(window=4)
    assert lengths.expected("chat", 64) == 64  # nothing learned: the whole max_tokens
    for n in (10, 20, 30, 40):
        lengths.add("chat", n)
    assert lengths.expected("chat", 64) == 25
    assert lengths.expected("chat", 20) == pytest.approx((10 + 20 + 20 + 20) / 4)  # E[min(O, max_tokens)]
    assert lengths.expected("chat", 64, produced=25) == pytest.approx(35 - 25)  # E[O - 25 | O > 25]
    assert lengths.expected("batch", 64) == 25  # a class not seen yet: everybody's lengths
    lengths.add("chat", 100)  # the window keeps the last 4
    assert lengths.expected("chat", 1000) == pytest.approx((20 + 30 + 40 + 100) / 4)
    assert lengths.spread("chat", 1000) == pytest.approx(math.sqrt(sum((x - 47.5) ** 2 for x in (20, 30, 40, 100)) / 4))


def test_simulate_k_slots():
    # two slots: the running requests free them after 1 s and 3 s; each job takes 2 s
    assert simulate([3.0, 1.0], [2.0, 2.0, 2.0], 2) == [1.0, 3.0, 3.0]
    assert simulate([], [5.0, 5.0], 1) == [0.0, 5.0]
    assert simulate([1.0], [1.0, 1.0], None) == [0.0, 0.0]
    assert simulate([4.0, 1.0, 2.0], [1.0], 2) == [2.0]  # more running than slots: it waits for room


def test_simulate_kv_blocks():
    """Capacity in KV blocks: a request starts, in order, once the blocks it reserves are free."""
    # 10 blocks; running: 4 blocks until 1 s, 4 blocks until 3 s (2 free now)
    # the 6-block one waits for both to free at 1 s; the last waits for its 6 blocks back at 2 s
    assert simulate([1.0, 3.0], [1.0, 1.0, 1.0], 10, held=[4, 4], needs=[2, 6, 1]) == [0.0, 1.0, 2.0]
    # strict order: the third (1 block) does not pass the second (6 blocks) that waits
    assert simulate([5.0], [1.0, 1.0, 1.0], 10, held=[8], needs=[2, 6, 1])[2] >= 5.0
    assert simulate([], [1.0], 4, needs=[9]) == [0.0]  # larger than everything: capped (it never fits)


def test_simulate_the_prefills_engine_beside_the_decodes():
    """Where the line also waits for the prefill's one engine, a request starts at the later of
    the decodes' room and the engine, and holds the engine for its prefill only."""
    # decodes unbounded; the engine finishes the prompts it took on in 0.3 s; prefills 0.2, 0.5, 0.1 s
    assert simulate([], [9.0, 9.0, 9.0], None, engine=[0.1, 0.3], prefills=[0.2, 0.5, 0.1]) == \
        pytest.approx([0.3, 0.5, 1.0])
    # the decodes full (one slot, freed at 2 s): the decodes bind, then the engine does not
    assert simulate([2.0], [1.0, 1.0], 1, engine=[0.3], prefills=[0.2, 0.2]) == pytest.approx([2.0, 3.0])
    # blocks held from the start the engine allows: the second waits for the first's blocks (0.4 + 1 s)
    assert simulate([], [1.0, 1.0], 10, needs=[6, 6], engine=[0.4], prefills=[0.1, 0.1]) == pytest.approx([0.4, 1.4])
    assert simulate([], [1.0], 1, engine=[], prefills=[0.5]) == [0.0]  # an idle engine: at once


def warm_estimator(per_token=0.01, outputs=(("chat", 100),)):
    est = Estimator()
    est.observe_gap(0.0, 10, 10 * per_token)
    est.observe_prefill(100, 0.05)
    for cls, n in outputs:
        est.observe_output(cls, n)
    return est


def test_plan_is_eq_1_to_4():
    est = warm_estimator()
    assert est.warm
    job = Job("chat", prompt_tokens=200, max_tokens=500)
    (e,) = est.plan([0.3], [job], capacity=1)
    assert e.wait == pytest.approx(0.3)                  # W: the running request frees the slot
    assert e.prefill == pytest.approx(0.10)              # P: 200 tokens at 0.05 s per 100
    assert e.decode == pytest.approx(99 * 0.01)          # D = (O - 1) * d, O learned (100 < max_tokens)
    assert e.total == pytest.approx(0.3 + 0.1 + 0.99)    # C = W + P + D
    assert e.first_token == pytest.approx(0.4)


def test_a_long_queue_waits_as_eq_2_says():
    """For many requests ahead, W_q = sum of the output tokens ahead / Theta, Theta = K / d
    (prefill is small here, as in QLM's setting)."""
    est = Estimator()
    est.observe_gap(0.0, 1, 0.02)  # d = 20 ms
    est.observe_prefill(1, 0.0)
    for n in (50, 150):  # mean 100, sigma 50
        est.observe_output("chat", n)
    k, q = 4, 200
    plan = est.plan([], [Job("chat", 1, 1000)] * q, capacity=k)
    eq2 = (q - 1) * 100 / (k / 0.02)
    assert plan[-1].wait == pytest.approx(eq2, rel=0.03)
    # eq. 3: the spread of the wait grows with the square root of the requests ahead
    assert plan[100].wait_sd == pytest.approx(math.sqrt(100) * 50 * 0.02 / k)


def test_capacity_is_what_was_seen_full():
    est = Estimator()
    assert est.capacity(running=3, queue_nonempty=False) is None  # never full: start at once
    assert est.capacity(running=3, queue_nonempty=True) == 3
    est.observe_full(6)
    assert est.capacity(running=2, queue_nonempty=False) == 6
    assert est.capacity(running=0, queue_nonempty=True) == 1


def test_plan_in_kv_blocks():
    est = warm_estimator()
    big, small = Job("chat", 100, 500, blocks=6), Job("chat", 100, 50, blocks=1)
    # 8 blocks; a running request holds 4 until 1 s: the big one waits for them, the small one behind it
    plan = est.plan([1.0], [big, small], 8, held=[4], by_blocks=True)
    assert [e.wait for e in plan] == pytest.approx([1.0, 1.0])
    assert est.plan([1.0], [small], 8, held=[4], by_blocks=True)[0].wait == 0.0  # room now


def test_the_per_token_time_is_token_weighted_over_a_window():
    rate = WindowRate(window_s=3.0)  # (the default is longer)
    assert rate.value is None
    rate.add(0.0, 1, 0.100)           # one slow gap (the process was descheduled) ...
    for i in range(9):
        rate.add(0.1 + i * 0.01, 1, 0.010)  # ... and nine normal ones
    assert rate.value == pytest.approx(0.190 / 10)
    rate.add(5.0, 4, 0.020)           # later: the old ones fall out of the window
    assert rate.value == pytest.approx(0.005)


def test_requests_that_run_to_their_limit():
    """A class whose requests always make max_tokens (ignore_eos): a request makes its own limit,
    whatever the others' limits were; a mixed class weighs both."""
    lengths = OutputLengths()
    for n in (50, 200, 400):
        lengths.add("batch", n, hit_limit=True)
    assert lengths.expected("batch", 300) == 300
    assert lengths.expected("batch", 300, produced=100) == 200
    assert lengths.spread("batch", 300) == 0.0
    for n in (10, 30):
        lengths.add("chat", n)           # stopped at EOS
    lengths.add("chat", 64, hit_limit=True)
    assert lengths.expected("chat", 64) == pytest.approx((10 + 30 + 64) / 3)
    # after 20 tokens the short one is ruled out: half the rest stop at 30, half run to 64
    assert lengths.expected("chat", 64, produced=20) == pytest.approx((10 + 44) / 2)
