"""GlobalQueue (pdserve.slo.global_queue) with a fake clock: the life of requests, the order
the policy gives, estimates and their errors, early rejection, and the per-class metrics."""

import pytest

from pdserve.metrics import ServerMetrics
from pdserve.slo import GlobalQueue, Rejected, parse

CLASSES = parse({"ttftMs": 5000, "defaultClass": "interactive", "classes": [
    {"name": "interactive", "ttftMs": 1000, "e2eMs": 3000, "earlyReject": True},
    {"name": "batch", "e2eMs": 60000}]})
INTERACTIVE, BATCH = CLASSES.by_name["interactive"], CLASSES.by_name["batch"]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def value(m: ServerMetrics, name: str, **labels) -> float:
    total = 0.0
    for metric in m.registry.collect():
        for s in metric.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def serve(q, clock, req, tokens=10, prefill=0.1, per_token=0.01):
    """Admit now, first token after ``prefill``, the rest ``per_token`` apart, finish."""
    q.admitted(req)
    clock.t += prefill
    q.token(req)
    clock.t += per_token * (tokens - 1)
    q.token(req, tokens - 1)
    q.finish(req, "ok")


def warm(q, clock, n=3, tokens=10):
    for i in range(n):  # each stops (at EOS) well before its max_tokens
        serve(q, clock, q.arrive(f"warm{i}", INTERACTIVE, 100, 1000), tokens)


def test_a_request_that_need_not_wait_and_its_metrics():
    clock, m = Clock(), ServerMetrics("prefill")
    q = GlobalQueue(CLASSES, "fifo", m, clock)
    req = q.arrive("r1", INTERACTIVE, 100, 16)
    assert req.estimate.wait == 0.0 and q.head() is None
    serve(q, clock, req, tokens=10, prefill=0.2, per_token=0.05)
    assert not q.waiting and not q.running
    assert value(m, "pdserve_slo_requests_total", slo_class="interactive", outcome="ok") == 1
    # TTFT 0.2 s <= 1 s; e2e 0.65 s <= 3 s
    for target in ("ttft", "e2e", "all"):
        assert value(m, "pdserve_slo_attainment_total", slo_class="interactive", target=target, result="met") == 1
    assert value(m, "pdserve_slo_queue_time_seconds_count", slo_class="interactive") == 1
    assert value(m, "pdserve_slo_estimate_error_seconds_count", slo_class="interactive", part="e2e") == 1
    rec = q.account.records[-1]
    assert rec["actual"]["first_token"] == pytest.approx(0.2) and rec["met"] == {"ttft": True, "e2e": True}
    # the estimator learned from it
    assert q.estimator.per_token.value == pytest.approx(0.05)
    assert q.estimator.prefill_time(100) == pytest.approx(0.2)
    assert q.estimator.lengths.expected("interactive", 64) == 10


def test_a_slow_request_misses_and_a_failed_one_misses_everything():
    clock, m = Clock(), ServerMetrics("prefill")
    q = GlobalQueue(CLASSES, "fifo", m, clock)
    serve(q, clock, q.arrive("slow", INTERACTIVE, 100, 16), tokens=10, prefill=1.5, per_token=0.01)
    failed = q.arrive("failed", BATCH, 100, 16)
    q.admitted(failed)
    q.finish(failed, "error")
    q.finish(failed, "ok")  # once only
    gone = q.arrive("gone", BATCH, 100, 16)
    q.finish(gone, "cancelled")
    assert value(m, "pdserve_slo_attainment_total", slo_class="interactive", target="ttft", result="missed") == 1
    assert value(m, "pdserve_slo_attainment_total", slo_class="interactive", target="e2e", result="met") == 1
    assert value(m, "pdserve_slo_attainment_total", slo_class="interactive", target="all", result="missed") == 1
    assert value(m, "pdserve_slo_attainment_total", slo_class="batch", target="e2e", result="missed") == 1
    assert value(m, "pdserve_slo_requests_total", slo_class="batch") == 2  # error + cancelled (not judged)
    assert value(m, "pdserve_slo_attainment_total", slo_class="batch") == 2  # e2e + all of the failed one


def fill(q, clock, running=2, max_tokens=64):
    """``running`` requests in service; the backend is full (one had to wait, then got in)."""
    reqs = [q.arrive(f"run{i}", BATCH, 100, max_tokens) for i in range(running)]
    for r in reqs:
        q.admitted(r)
    clock.t += 0.1  # their prefill
    for r in reqs:
        q.token(r)
    probe = q.arrive("probe", BATCH, 100, 64)
    q.wait(probe)  # seen full with `running` running
    q.finish(probe, "cancelled")
    return reqs


def test_the_policy_orders_the_waiting_requests():
    for policy, first in (("fifo", "b0"), ("edf", "i0"), ("qlm", "i0")):
        clock = Clock()
        q = GlobalQueue(CLASSES, policy, None, clock)
        warm(q, clock)
        fill(q, clock)
        batch = [q.arrive(f"b{i}", BATCH, 100, 64) for i in range(5)]
        for r in batch:
            q.wait(r)
        clock.t += 0.05
        late = q.arrive("i0", INTERACTIVE, 100, 10)
        q.wait(late)
        assert q.head().request_id == first, policy
        assert len(q.order()) == 6
        # leaving the queue in any state takes it out of the order at once
        q.finish(late, "cancelled")
        assert "i0" not in [r.request_id for r in q.order()] and len(q.waiting) == 5


def test_the_estimate_at_arrival_is_its_place_in_line():
    clock = Clock()
    q = GlobalQueue(CLASSES, "fifo", None, clock)
    warm(q, clock)  # prefill 0.1 s, 10 tokens at 10 ms: 0.19 s of service each
    running = fill(q, clock, running=2)  # each has made 1 token of ~10 expected: frees in ~0.09 s
    waiting = []
    for i in range(4):
        waiting.append(q.arrive(f"w{i}", INTERACTIVE, 100, 64))
        q.wait(waiting[-1])
    waits = [w.estimate.wait for w in waiting]
    assert waits == pytest.approx([0.09, 0.09, 0.28, 0.28])  # two slots: pairs
    # the estimate's error is kept when it leaves the queue
    m = ServerMetrics("prefill")
    q.account.metrics = m
    clock.t += 0.09
    for r in running:
        q.finish(r, "ok")
    q.admitted(waiting[0])
    assert value(m, "pdserve_slo_estimate_error_seconds_sum", part="queue") == pytest.approx(0.0, abs=1e-9)


def test_early_rejection_with_the_estimate():
    clock, m = Clock(), ServerMetrics("prefill")
    q = GlobalQueue(CLASSES, "fifo", m, clock)
    # a cold estimator never rejects
    fill(q, clock, running=1)
    assert q.arrive("cold", INTERACTIVE, 100, 10).state == "new"
    clock = Clock()
    q = GlobalQueue(CLASSES, "fifo", m, clock)
    warm(q, clock, tokens=200)  # requests make 200 tokens at 10 ms: 2 s each
    fill(q, clock, running=1, max_tokens=300)  # one slot, busy for ~2 s more
    with pytest.raises(Rejected) as err:
        q.arrive("hopeless", INTERACTIVE, 100, 300)
    msg = str(err.value)
    assert "SLO class 'interactive' cannot be met even if this request were served next" in msg
    assert "first token in 2.09s (target 1000 ms)" in msg and "completion in 4.08s (target 3000 ms)" in msg
    assert err.value.retry_after_s == 2  # ceil(4.08 - 3)
    assert err.value.estimate.wait == pytest.approx(1.99)
    assert "hopeless" not in q.waiting and "hopeless" not in q.running
    assert value(m, "pdserve_slo_requests_total", slo_class="interactive", outcome="rejected") == 1
    assert value(m, "pdserve_slo_attainment_total", slo_class="interactive", target="all", result="missed") == 1
    assert q.account.records[-1]["outcome"] == "rejected"
    # batch has no early rejection: it queues
    assert q.arrive("patient", BATCH, 100, 300).estimate.wait == pytest.approx(1.99)


def test_the_prefill_estimate_counts_the_tokens_to_compute_not_the_cached_prefix():
    clock = Clock()
    q = GlobalQueue(CLASSES, "qlm", None, clock)
    # 4,000-token prompts: one all new (0.4 s), one with 3,968 tokens cached (32 computed, 0.0032 s)
    serve(q, clock, q.arrive("cold", INTERACTIVE, 4000, 10), prefill=0.4)
    serve(q, clock, q.arrive("hit", INTERACTIVE, 4000, 10, cached_tokens=3968), prefill=0.0032)
    fit = q.estimator.prefill_fit
    assert fit.predict(32) == pytest.approx(0.0032, rel=0.01)  # learned by tokens computed: a line through both
    assert fit.predict(4000) == pytest.approx(0.4, rel=0.01)
    again = q.arrive("again", INTERACTIVE, 4000, 10, cached_tokens=3968)
    assert again.job.computed_tokens == 32 and again.inputs["cached_tokens"] == 3968
    assert again.estimate.prefill == pytest.approx(0.0032, rel=0.01)
    assert q.arrive("new", INTERACTIVE, 4000, 10).estimate.prefill == pytest.approx(0.4, rel=0.01)
    # a claimed hit longer than the prompt still computes the last token
    assert q.arrive("odd", INTERACTIVE, 10, 10, cached_tokens=64).job.computed_tokens == 1


def test_a_prefill_bound_line_plans_one_engine_and_qlm_serves_who_can_still_make_it_first():
    """The prefill's slots gate the line (``prefill_bound``): beside the decodes' KV blocks (plenty
    here), the plan counts its one engine, computing the admitted prompts first, then the line one
    prompt after another, each holding the engine for its prefill only."""
    clock = Clock()
    q = GlobalQueue(CLASSES, "qlm", None, clock, kv_capacity=lambda: 10_000)
    q.prefill_bound = True
    for i in range(3):  # 1,000 tokens take 0.5 s
        serve(q, clock, q.arrive(f"w{i}", INTERACTIVE, 1000, 10), prefill=0.5)
    t0 = clock.t
    old = q.arrive("old", INTERACTIVE, 1000, 10)  # it has waited 0.8 s when the plan below is made
    q.wait(old, full=False)
    clock.t = t0 + 0.7
    computing = q.arrive("computing", INTERACTIVE, 1000, 10)
    q.admitted(computing)  # the engine is computing it: 0.4 s left at t0 + 0.8
    clock.t = t0 + 0.8
    new = q.arrive("new", INTERACTIVE, 400, 10)  # 0.2 s of prefill
    q.wait(new, full=False)
    ctx = q.context()
    assert ctx.by_blocks and ctx.slots == 10_000 and ctx.engine == pytest.approx((0.4,))
    # first come first served: "old" starts at +0.4 (TTFT 1.7 s) and "new" at +0.9 (TTFT 1.1 s): both miss
    # 1 s; qlm: "old" cannot make it whatever the order, so "new" goes first (TTFT 0.6 s) and one is met
    assert [r.request_id for r in q.order()] == ["new", "old"]
    # its estimate at arrival placed it by deadline, behind "old": the computing prompt's 0.4 s and old's 0.5 s
    assert new.estimate.wait == pytest.approx(0.9) and new.estimate.prefill == pytest.approx(0.2)
    q.prefill_bound = False  # the decodes' KV blocks alone: plenty, nobody waits for them
    assert q.context().engine is None and q.arrive("later", BATCH, 400, 10).estimate.wait == pytest.approx(0.0)
    assert q.estimator.slots.value is None  # waiting for a prefill slot is not "the backend is full"


def test_a_prefill_bound_line_with_the_decodes_full_waits_for_their_blocks():
    """The engine idle but the decodes' blocks all held: a request waits for the blocks (as
    without the prefill's slots in the line), so a TTFT it cannot meet is rejected at arrival."""
    clock = Clock()
    q = GlobalQueue(CLASSES, "edf", None, clock, kv_capacity=lambda: 10)
    q.prefill_bound = True
    serve(q, clock, q.arrive("warm", BATCH, 10, 300), tokens=300, prefill=0.01, per_token=0.01)
    running = [q.arrive(f"r{i}", BATCH, 10, 300, blocks=5) for i in range(2)]
    for r in running:
        q.admitted(r)
        q.token(r)  # computed: the engine is free, the decodes are full for about 3 s
    assert q.context().engine == ()
    est = q.arrive("b", BATCH, 10, 300, blocks=5).estimate
    assert est.wait == pytest.approx(3.0, rel=0.05), est  # the running requests' 299 tokens left
    with pytest.raises(Rejected):
        q.arrive("i", INTERACTIVE, 10, 8, blocks=1)
def test_the_queued_gauge_per_class():
    clock, m = Clock(), ServerMetrics("prefill")
    q = GlobalQueue(CLASSES, "edf", m, clock)
    assert value(m, "pdserve_slo_queued", slo_class="batch") == 0
    reqs = [q.arrive(f"b{i}", BATCH, 10, 10) for i in range(3)]
    for r in reqs:
        q.wait(r)
    assert value(m, "pdserve_slo_queued", slo_class="batch") == 3
    assert q.head() is reqs[0]
    q.admitted(reqs[0])
    q.finish(reqs[1], "cancelled")
    assert value(m, "pdserve_slo_queued", slo_class="batch") == 1
    q.finish(reqs[2], "error")
    assert value(m, "pdserve_slo_queued", slo_class="batch") == 0 and not q.waiting
    q.finish(reqs[0], "ok")
    assert not q.running
    assert value(m, "pdserve_slo_policy_seconds_count") >= 1
    snap = q.snapshot()
    assert snap["policy"] == "edf" and snap["waiting"] == {"default": 0, "interactive": 0, "batch": 0}


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown queue policy 'lifo'"):
        GlobalQueue(CLASSES, "lifo")


def test_qlm_decides_at_most_every_50ms_arrivals_go_in_by_edf_between():
    clock, m = Clock(), ServerMetrics("prefill")
    q = GlobalQueue(CLASSES, "qlm", m, clock)
    warm(q, clock)
    fill(q, clock)
    decisions = lambda: value(m, "pdserve_slo_policy_seconds_count")  # noqa: E731
    for i in range(3):
        q.wait(q.arrive(f"b{i}", BATCH, 100, 64))
    q.head()
    first = decisions()
    late = q.arrive("i0", INTERACTIVE, 100, 10)
    q.wait(late)
    assert q.head() is late and decisions() == first  # put in by EDF, no new decision yet
    clock.t += 0.06
    assert q.head() is late and decisions() == first + 1  # the full decision after the interval
    clock.t += 0.6
    q.head()
    assert decisions() == first + 2  # and again while requests wait


def test_a_new_head_is_woken_also_when_only_time_changed_the_order():
    """qlm's order changes with time (a request that can no longer make it goes to the tail):
    the new head's wakeup is called, or it would sleep until its deadline."""
    from pdserve.slo import Estimator

    classes = parse({"classes": [{"name": "interactive", "ttftMs": 1000}, {"name": "chat", "ttftMs": 2000},
                                 {"name": "batch", "e2eMs": 60000}]})
    est = Estimator()
    est.observe_gap(0.0, 1, 0.01)
    est.observe_prefill(100, 0.1)
    for cls, n in (("interactive", 20), ("chat", 20), ("batch", 50)):
        est.observe_output(cls, n)
    clock = Clock()
    q = GlobalQueue(classes, "qlm", None, clock, est)
    busy = q.arrive("busy", classes.by_name["batch"], 100, 100)
    q.admitted(busy)  # frees its slot in ~0.5 s (50 tokens expected)
    woken = []
    i, c = q.arrive("i", classes.by_name["interactive"], 100, 20), q.arrive("c", classes.by_name["chat"], 100, 20)
    for r in (i, c):
        r.wakeup = (lambda name: lambda: woken.append(name))(r.request_id)
        q.wait(r)
    assert q.head() is i
    woken.clear()
    clock.t += 1.2  # i must start by 0.9 s after its arrival: lost; c would be late behind it
    assert q.head() is c and woken == ["c"]
