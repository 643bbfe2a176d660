"""The pipeline engine's prompts go through the engine's one Scheduler (2 real stage processes over gloo):

- both schedules (mixed, td-pipe) admit waiting prompts in the SLO queue's order: the order a
  ``pdserve.slo.GlobalQueue`` gives under edf and qlm, passed as each request's priority (its rank),
  as the one-process engine takes it;
- a long prompt is computed in chunks under the token budget (a micro-batch never holds more than
  ``max_num_batched_tokens`` tokens, each chunk before the last ends on a block boundary and is at most
  ``long_prefill_threshold`` tokens while a short prompt waits, and the short one enters beside the long
  one's first chunk), with the one-process engine's tokens, greedy and seeded;
- afterwards nothing is held: every KV block free, no request state, nothing in flight.
"""

import random

import torch

from pdserve.batch.pipeline.engine import PipelineConfig, PipelineEngine
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, load_model
from pdserve.slo import Estimator, GlobalQueue, parse

BLOCK = 16
GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
CLASSES = parse({"classes": [{"name": "interactive", "ttftMs": 1000}, {"name": "chat", "ttftMs": 3000},
                             {"name": "batch", "e2eMs": 60000}]})
ARRIVALS = [("b0", "batch"), ("b1", "batch"), ("c0", "chat"), ("i0", "interactive"), ("b2", "batch"),
            ("i1", "interactive")]  # in this order, 10 ms apart


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _slo_order(policy: str, prompts: dict[str, list[int]]) -> list[str]:
    """The request ids in the order a GlobalQueue with ``policy`` serves them (all waiting)."""
    est = Estimator()
    est.observe_gap(0.0, 1, 0.01)
    est.observe_prefill(100, 0.1)
    for cls, n in (("interactive", 3), ("chat", 3), ("batch", 3)):
        est.observe_output(cls, n)
    clock = Clock()
    q = GlobalQueue(CLASSES, policy, None, clock, est)
    busy = q.arrive("busy", CLASSES.by_name["batch"], 100, 100)
    q.admitted(busy)  # the backend is busy: the others wait
    for rid, cls in ARRIVALS:
        clock.t += 0.01
        q.wait(q.arrive(rid, CLASSES.by_name[cls], len(prompts[rid]), GREEDY.max_tokens))
    return [r.request_id for r in q.order()]


def _spans(eng: PipelineEngine) -> list[list[tuple[str, int, int, int]]]:
    """Record each micro-batch sent: (request id, first token, end, tokens in all) of each row."""
    sent = []
    real = eng._send

    def spy(seqs):
        sent.append([(s.request_id, s.num_computed, s.chunk_end, s.num_tokens) for s in seqs])
        return real(seqs)

    eng._send = spy
    return sent


def _assert_nothing_held(eng: PipelineEngine, num_blocks: int) -> None:
    assert eng.block_manager.num_free_blocks() == num_blocks
    assert not eng.seqs and not eng.ready and not eng.waiting and not eng.in_flight
    assert not eng.scheduler.running and eng.scheduler.num_requests() == 0


def test_both_schedules_admit_in_the_slo_queues_order():
    rng = random.Random(1)
    prompts = {rid: [rng.randrange(3, 250) for _ in range(rng.randint(5, 40))] for rid, _ in ARRIVALS}
    orders = {policy: _slo_order(policy, prompts) for policy in ("fifo", "edf", "qlm")}
    arrival = [rid for rid, _ in ARRIVALS]
    assert orders["fifo"] == arrival
    assert orders["edf"] == ["i0", "i1", "c0", "b0", "b1", "b2"]
    assert orders["qlm"] != arrival and sorted(orders["qlm"]) == sorted(arrival)
    cfg = PipelineConfig(num_stages=2, schedule="mixed", num_blocks=32, block_size=BLOCK, max_num_seqs=1,
                         max_num_batched_tokens=64)
    with PipelineEngine("tiny", cfg) as eng:
        sent = _spans(eng)
        for schedule in ("mixed", "td-pipe"):
            eng.set_schedule(schedule)
            for policy in ("edf", "qlm"):  # (fifo: arrival order, what the schedules did before)
                order = orders[policy]
                sent.clear()
                rank = {rid: i for i, rid in enumerate(order)}
                for rid in arrival:  # they arrive in arrival order; the queue's order is their priority
                    eng.add_request(rid, prompts[rid], GREEDY, priority=rank[rid])
                out = eng.run()
                firsts = list(dict.fromkeys(rid for batch in sent for rid, *_ in batch))
                assert firsts == order, (schedule, policy)
                assert all(len(o.new_token_ids) == 3 and o.finished for o in out.values())
                _assert_nothing_held(eng, 32)


def _one_process(requests, num_blocks):
    torch.set_num_threads(1)
    eng = LLMEngine(load_model("tiny"), EngineConfig(num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=8,
                                                     max_num_batched_tokens=2048, long_prefill_threshold=0))
    for rid, ids, sp in requests:
        eng.add_request(rid, ids, sp)
    out = {}
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_a_long_prompt_is_chunked_by_the_budget_and_a_short_one_passes_it():
    rng = random.Random(2)
    long = [rng.randrange(3, 250) for _ in range(150)]
    shorts = [[rng.randrange(3, 250) for _ in range(n)] for n in (9, 12, 6)]
    seeded = SamplingParams(max_tokens=5, temperature=0.8, top_k=20, seed=7, ignore_eos=True)
    requests = [("long", long, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))]
    requests += [(f"short{i}", ids, seeded if i == 1 else GREEDY) for i, ids in enumerate(shorts)]
    expected = _one_process(requests, 64)  # the whole prompt in one pass
    budget, threshold = 32, 16
    cfg = PipelineConfig(num_stages=2, schedule="td-pipe", num_blocks=64, block_size=BLOCK, max_num_seqs=8,
                         max_num_batched_tokens=budget, long_prefill_threshold=threshold)
    with PipelineEngine("tiny", cfg) as eng:
        sent = _spans(eng)
        for schedule in ("td-pipe", "mixed"):
            eng.set_schedule(schedule)
            sent.clear()
            for rid, ids, sp in requests:
                eng.add_request(rid, ids, sp)
            out = eng.run()
            assert {rid: o.new_token_ids for rid, o in out.items()} == expected, schedule
            _assert_nothing_held(eng, 64)
            _assert_chunked(sent, len(long), budget, threshold)


def _assert_chunked(sent, n_long: int, budget: int, threshold: int) -> None:
    assert all(sum(end - start for _, start, end, _ in batch) <= budget for batch in sent)
    long_spans = [(start, end) for batch in sent for rid, start, end, _ in batch
                  if rid == "long" and start < n_long]
    assert len(long_spans) > n_long // budget  # in chunks, none longer than the budget
    assert long_spans[0][0] == 0 and long_spans[-1][1] == n_long
    assert all(a[1] == b[0] for a, b in zip(long_spans, long_spans[1:]))  # each token computed once, in order
    assert all(end % BLOCK == 0 for _, end in long_spans[:-1])  # a chunk before the last ends on a block
    first = [(rid, start, end) for rid, start, end, _ in sent[0]]
    assert first[:2] == [("long", 0, threshold), ("short0", 0, 9)]  # the short one beside the long one's first chunk
