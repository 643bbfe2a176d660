"""TD-Pipe's switch points and work stealing as pure logic, on simulated memory traces."""

import random

import pytest

from pdserve.engine.block_manager import blocks_needed
from pdserve.batch.pipeline.switch import (
    FutureMemory,
    LinearCost,
    WorkStealer,
    admit_prompts,
    future_points,
    prefill_microbatches,
    should_prefill,
    spatial_intensity,
    temporal_intensity,
)


def simulate_peak(requests, block_size):
    """Exact peak blocks of lockstep decoding of (kv_tokens, remaining_steps) requests."""
    peak = 0
    for s in range(max(r for _, r in requests) + 1):
        peak = max(peak, sum(blocks_needed(kv + s, block_size) for kv, r in requests if s <= r))
    return peak


def test_future_points_cover_horizon():
    assert future_points(100, 32) == (0, 32, 64, 96, 128)
    with pytest.raises(ValueError, match="step"):
        future_points(10, 0)


def test_contribution_grows_then_frees():
    mem = FutureMemory(capacity_blocks=100, block_size=16, points=(0, 10, 20, 30))
    # 10 tokens of KV, 20 more steps: 1 block now, 2 at step 10, 2 at step 20 (30 tokens), freed after
    assert mem.contribution(10, 20) == [1, 2, 2, 0]
    mem.add(10, 20)
    assert mem.usage == {0: 1, 10: 2, 20: 2, 30: 0}


def test_greedy_prefill_admits_more_than_final_sizes_allow():
    """Requests finish at different steps, so the simulated peak admits more requests than
    reserving every request's final size would (the point of the memory simulation)."""
    bs, cap = 16, 100
    prompts = [(32, 16 * (i % 8 + 1)) for i in range(40)]  # outputs 16 .. 128 tokens
    mem = FutureMemory(cap, bs, future_points(128, 8))
    n = admit_prompts(mem, prompts)
    reserve_all = 0
    used = 0
    for p, o in prompts:
        need = blocks_needed(p + o, bs)
        if used + need > cap:
            break
        used += need
        reserve_all += 1
    assert n > reserve_all
    # and the exact peak of what was admitted still fits
    admitted = [(p, o - 1) for p, o in prompts[:n]]
    assert simulate_peak(admitted, bs) <= cap
    assert mem.peak() <= cap
    # one more would not have fitted at some point
    assert not mem.fits(prompts[n][0], prompts[n][1] - 1)


def test_switch_point_on_random_traces_never_exceeds_capacity():
    rng = random.Random(7)
    for trial in range(20):
        bs = rng.choice([8, 16, 64])
        cap = rng.randint(50, 400)
        running = [(rng.randint(1, 300), rng.randint(0, 200)) for _ in range(rng.randint(0, 10))]
        mem = FutureMemory(cap, bs, future_points(400, 32))  # coarse points: the last steps keep it exact
        for kv, r in running:
            mem.add(kv, r)
        if mem.peak() > cap:
            continue
        prompts = [(rng.randint(1, 300), rng.randint(1, 200)) for _ in range(60)]
        n = admit_prompts(mem, prompts)
        admitted = running + [(p, o - 1) for p, o in prompts[:n]]
        assert simulate_peak(admitted, bs) <= cap, trial
        if n < len(prompts):
            nxt = prompts[n]
            assert simulate_peak(admitted + [(nxt[0], nxt[1] - 1)], bs) > cap, trial


def test_prompt_that_fits_now_but_not_later_ends_the_phase():
    mem = FutureMemory(capacity_blocks=10, block_size=10, points=(0, 50, 100))
    mem.add(40, 100)  # 4 blocks now, 9 at step 50, 14 at step 100 (its last)
    assert mem.usage == {0: 4, 50: 9, 100: 14}
    mem = FutureMemory(capacity_blocks=12, block_size=10, points=(0, 50, 100))
    mem.add(10, 60)  # 1 block now, 6 at step 50, 7 at step 60 (its last), 0 at 100
    assert mem.fits(10, 50)  # + 1, 6 -> 12 at step 50; freed before 60
    assert not mem.fits(10, 60)  # 7 + 7 = 14 at step 60 although 12 at every fixed point
    # FIFO: the first does not fit at step 50, so the phase ends although the second would fit
    assert admit_prompts(mem, [(20, 61), (10, 5)]) == 0
    assert admit_prompts(mem, [(10, 51), (10, 51)]) == 1
    assert mem.usage == {0: 2, 50: 12, 60: 7, 100: 0}



def test_linear_cost_fit_and_prior():
    c = LinearCost(prior=(0.01, 0.001))
    assert c(10) == pytest.approx(0.02)
    c.observe(10, 0.05)  # one size: the prior slope, the intercept fitted
    assert c(10) == pytest.approx(0.05)
    for x in (8, 16, 32, 64):
        c.observe(x, 0.002 + 0.0005 * x)
    c.samples.popleft()
    a, b = c.coefficients()
    assert a == pytest.approx(0.002) and b == pytest.approx(0.0005)


def test_spatial_intensity_falls_with_batch_size():
    cost = LinearCost(prior=(0.02, 0.001))  # fixed cost dominates small batches
    assert spatial_intensity(256, cost, 256) == pytest.approx(1.0)
    assert spatial_intensity(4, cost, 256) < spatial_intensity(32, cost, 256) < spatial_intensity(128, cost, 256) < 1
    assert spatial_intensity(0, cost, 256) == 0


def test_temporal_intensity_and_the_switch_rule():
    decode = LinearCost(prior=(0.02, 0.001))
    prefill = LinearCost(prior=(0.01, 0.0002))
    assert prefill_microbatches([300, 300, 500, 2000, 10], 1024) == [600, 500, 2000, 10]
    # nothing to prefill: never switch
    assert temporal_intensity([], 8, 2, prefill, decode) == 0
    assert not should_prefill(0.1, 0.0)
    # many prefill micro-batches: the bubble is small against the phase
    many = temporal_intensity([1024] * 20, 64, 2, prefill, decode)
    one = temporal_intensity([1024], 64, 2, prefill, decode)
    assert 0 < one < many < 1
    # a large decode batch stays (efficient); a tiny one leaves for a long prefill phase
    big = spatial_intensity(200, decode, 256)
    tiny = spatial_intensity(2, decode, 256)
    assert not should_prefill(big, many)
    assert should_prefill(tiny, many)
    # more stages, more bubble
    assert temporal_intensity([1024] * 3, 8, 4, prefill, decode) < temporal_intensity([1024] * 3, 8, 2, prefill, decode)


def test_work_stealing_paper_example():
    """Figure 9: four batches of 128; batch 0 loses 48, batch 1 loses 8."""
    ws = WorkStealer(4)
    batches = [list(range(i * 128, (i + 1) * 128)) for i in range(4)]
    ws.start(batches)
    b0 = ws.rebalance(batches[0][:80], 48)
    assert len(b0) == 80  # below the average of 116: resubmitted whole
    b1 = ws.rebalance(batches[1][:120], 8)
    assert len(b1) == 114 and len(ws.pool) == 6  # average 114: 6 stolen
    b2 = ws.rebalance(batches[2], 0)
    b3 = ws.rebalance(batches[3], 0)
    assert len(b2) < 128 and len(b3) < 128
    held = len(ws.pool)
    b0b = ws.rebalance(b0, 0)  # the light batch gets the stolen requests
    assert len(b0b) > 80 and len(ws.pool) < held
    sizes = [len(b1), len(b2), len(b3), len(b0b)]
    assert max(sizes) - min(sizes) < 48 - 8  # closer than before stealing
    everyone = set(b0b) | set(b1) | set(b2) | set(b3) | set(ws.pool)
    assert len(everyone) == 80 + 120 + 128 + 128  # nobody lost or duplicated
    assert sizes == [114, 114, 114, 114] and not ws.pool  # 456 requests, 4 equal batches


def test_late_arrivals_in_the_pool_fill_the_batches():
    """Requests whose prefill returns after the decode phase started wait in the pool; the
    average counts them, so returning batches grow to take them all."""
    ws = WorkStealer(2)
    ready = []
    ws.pool = ready  # shared with the engine's ready list, as the td-pipe schedule does
    a, b = list(range(5)), list(range(5, 10))
    ws.start([a, b])
    assert ws.pool is ready
    ready.extend(range(10, 60))  # 50 late arrivals
    a = ws.rebalance(a, 0)
    b = ws.rebalance(b, 0)
    assert len(a) == 30 and len(b) == 30 and not ws.pool


def test_work_stealing_balances_uneven_finishes():
    for enabled in (True, False):
        ws = WorkStealer(2)
        ws.enabled = enabled
        batches = [list(range(100)), list(range(100, 200))]
        ws.start(batches)
        spreads = []
        for step in range(30):
            i = step % 2
            # batch 0 finishes requests much faster than batch 1
            kill = 6 if i == 0 else 1
            keep = batches[i][kill:]
            batches[i] = ws.rebalance(keep, min(kill, len(batches[i])))
            spreads.append(abs(len(batches[0]) - len(batches[1])))
        if enabled:
            on = max(spreads[10:])
        else:
            off = max(spreads[10:])
    assert on < off


def test_a_thin_decode_tail_runs_as_fewer_batches():
    """min_batch 4: with 2 batches cycling and fewer than 8 requests live, a returning batch
    dissolves into the pool and the next one takes them all; from then one batch cycles."""
    ws = WorkStealer(2, min_batch=4)
    a, b = list(range(6)), list(range(6, 12))
    ws.start([a, b])
    a = ws.rebalance(a[:5], 1)  # 11 live: still 2 batches
    assert len(a) == 5 and ws.num_batches == 2
    b = ws.rebalance(b[:2], 4)  # 7 live < 2 x 4: b dissolves
    assert b == [] and ws.num_batches == 1 and len(ws.pool) == 2
    a = ws.rebalance(a, 0)  # a takes the pool
    assert len(a) == 7 and not ws.pool
    assert ws.rebalance(a[:1], 6) == a[:1] and ws.num_batches == 1  # never below one batch
    with pytest.raises(ValueError, match="min_batch"):
        WorkStealer(2, min_batch=0)


def test_start_counts_the_batches_still_in_flight():
    ws = WorkStealer(3)
    ws.start([[1, 2]], in_flight=1)
    assert ws.num_batches == 2
    ws.start([[1], [2], [3]], in_flight=2)
    assert ws.num_batches == 3  # never more than it was built for
