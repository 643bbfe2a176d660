"""Ordering policies of the global queue on synthetic queues (pdserve.slo.policies, groups)."""

import random

import pytest

from pdserve.slo.classes import SloClass
from pdserve.slo.estimator import Estimator, Job
from pdserve.slo.groups import Waiting, length_bucket, make_groups
from pdserve.slo.policies import Context, evaluate, order, qlm

INTERACTIVE = SloClass("interactive", ttft_ms=1000, e2e_ms=3000)
BATCH = SloClass("batch", e2e_ms=60_000)
BEST_EFFORT = SloClass("default")


def estimator(per_token=0.01, outputs=(("interactive", 20), ("batch", 200))):
    est = Estimator()
    est.observe_gap(0.0, 1, per_token)
    est.observe_prefill(100, 0.0)  # prefill is free here: the queue's effect alone
    for cls, n in outputs:
        est.observe_output(cls, n)
    return est


class Queue:
    def __init__(self):
        self.items: list[Waiting] = []

    def add(self, cls, arrival, max_tokens, prompt=100, n=1):
        for _ in range(n):
            self.items.append(Waiting(f"{cls.name}-{len(self.items)}", cls, arrival, len(self.items),
                                      Job(cls.name, prompt, max_tokens)))
        return self


def missed(ordered, ctx, cls):
    """Requests of ``cls`` that would miss their SLO in this order."""
    only = [w for w in ordered]
    late_before = evaluate(only, ctx)[0]
    # count per class: evaluate with the other classes' deadlines lifted
    from pdserve.slo.policies import latest_start
    from pdserve.slo.estimator import simulate
    services = [ctx.estimator.service(w.job) for w in ordered]
    starts = simulate(list(ctx.frees_in), [p + d for p, d, _ in services], ctx.slots)
    per = sum(1 for w, s, (p, d, _) in zip(ordered, starts, services)
              if w.cls is cls and s > latest_start(w, p, d, ctx.now) + 1e-9)
    assert per <= late_before
    return per


def burst_then_interactive():
    """20 batch requests (2 s of decode each) just ahead of 4 interactive ones (0.2 s each,
    first token within 1 s); two slots, both free now."""
    return Queue().add(BATCH, 0.0, 200, n=20).add(INTERACTIVE, 0.1, 20, n=4).items


def test_a_batch_burst_ahead_of_interactive_requests():
    ctx = Context(now=0.2, estimator=estimator(), slots=2)
    waiting = burst_then_interactive()
    fifo, edf, by_qlm = (order(p, waiting, ctx) for p in ("fifo", "edf", "qlm"))
    assert [w.seq for w in fifo] == list(range(24))
    assert missed(fifo, ctx, INTERACTIVE) == 4            # 20 s behind the batch: every one late
    assert missed(edf, ctx, INTERACTIVE) == 0
    assert missed(by_qlm, ctx, INTERACTIVE) == 0
    for ordered in (fifo, edf, by_qlm):                  # the batch has a minute: on time in any order
        assert missed(ordered, ctx, BATCH) == 0
    assert [w.cls for w in by_qlm[:4]] == [INTERACTIVE] * 4


def test_qlm_beats_edf_when_not_everybody_can_make_it():
    """One slot. EDF serves the request with the earliest deadline even when its length makes
    the next two late (Moore-Hodgson's example); qlm gives up that one and saves the others."""
    tight = SloClass("tight", e2e_ms=3000)     # a 3 s job due at 3 s
    short = SloClass("short", e2e_ms=2000)     # a 1 s job due at 2 s
    later = SloClass("later", e2e_ms=3500)     # a 1 s job due at 3.5 s
    est = estimator(per_token=0.01, outputs=(("tight", 300), ("short", 100), ("later", 100)))
    waiting = Queue().add(short, 0.0, 100).add(tight, 0.0, 300).add(later, 0.0, 100).items
    ctx = Context(now=0.0, estimator=est, slots=1)
    assert evaluate(order("edf", waiting, ctx), ctx)[0] == 2
    ordered = order("qlm", waiting, ctx)
    assert evaluate(ordered, ctx)[0] == 1
    assert [w.cls.name for w in ordered] == ["short", "later", "tight"]


def test_a_request_late_even_if_first_costs_nobody_else_their_slo():
    est = estimator()
    ctx = Context(now=5.0, estimator=est, frees_in=(0.5,), slots=1)  # the slot frees in 0.5 s
    # interactive-0 is due at 5.0 (first token within 1 s of 4.0): lost whatever we do;
    # interactive-1 must start within 0.6 s; the batch request has a minute
    waiting = Queue().add(INTERACTIVE, 4.0, 20).add(INTERACTIVE, 4.6, 20).add(BATCH, 0.0, 200).items
    ordered = qlm(waiting, ctx)
    assert [w.request_id for w in ordered] == ["interactive-1", "interactive-0", "batch-2"]
    assert evaluate(ordered, ctx)[0] == 1
    assert evaluate(order("fifo", waiting, ctx), ctx)[0] == 2


def test_qlm_never_loses_to_edf_or_fifo_on_random_queues():
    rng = random.Random(7)
    classes = [INTERACTIVE, BATCH, SloClass("mid", ttft_ms=4000, e2e_ms=10_000), BEST_EFFORT]
    better = 0
    for trial in range(200):
        q = Queue()
        for arrival in sorted(rng.uniform(0, 3) for _ in range(rng.randint(2, 40))):
            cls = rng.choice(classes)
            q.add(cls, arrival, 20 if cls is INTERACTIVE else rng.choice([50, 200]))
        ctx = Context(now=3.0, estimator=estimator(), frees_in=tuple(rng.uniform(0, 2) for _ in range(3)),
                      slots=rng.choice([1, 3, 4]))
        late = {p: evaluate(order(p, q.items, ctx), ctx)[0] for p in ("fifo", "edf", "qlm")}
        assert late["qlm"] <= min(late["fifo"], late["edf"]), (trial, late)
        better += late["qlm"] < late["edf"]
        assert sorted(w.seq for w in order("qlm", q.items, ctx)) == sorted(w.seq for w in q.items)
    assert better >= 50  # overloaded queues: giving up the right requests saves more of the others


def test_edf_puts_best_effort_last_fifo_among_themselves():
    waiting = Queue().add(BEST_EFFORT, 0.0, 10, n=2).add(BATCH, 1.0, 10).add(INTERACTIVE, 2.0, 10).items
    ordered = order("edf", waiting, Context(0.0, estimator()))
    assert [w.request_id for w in ordered] == ["interactive-3", "batch-2", "default-0", "default-1"]


def test_groups_by_class_and_length_split_in_halves():
    est = estimator()
    waiting = Queue().add(BATCH, 0.0, 200, n=5).add(INTERACTIVE, 0.0, 20, n=2).add(
        INTERACTIVE, 0.0, 20, prompt=2000).items
    groups = make_groups(waiting, est.output_tokens, max_size=2)
    shape = [(g.cls.name, g.bucket, [w.seq for w in g.members]) for g in groups]
    assert shape == [("batch", length_bucket(300), [0, 1]), ("batch", length_bucket(300), [2]),
                     ("batch", length_bucket(300), [3, 4]), ("interactive", length_bucket(120), [5, 6]),
                     ("interactive", length_bucket(2020), [7])]
    with pytest.raises(ValueError):
        make_groups(waiting, est.output_tokens, 0)


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown queue policy 'sjf'; known: fifo, edf, qlm"):
        order("sjf", [], Context(0.0, estimator()))
