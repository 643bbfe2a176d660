"""Scheduler.schedule_prompts (engine/scheduler.py), the prompt work of a step that the pipeline engine's
schedules take every prompt through: chunks of prompts part-way first, then waiting prompts in the queue's
order; a caller's ``admits`` check has the last word on each prompt and a refusal leaves nothing taken."""

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence, Status

SP = SamplingParams(max_tokens=4, temperature=0)


def _seq(rid: str, n: int, arrival: int, priority: float = 0.0) -> Sequence:
    seq = Sequence(rid, list(range(3, 3 + n)), SP, arrival)
    seq.priority = priority
    return seq


def _scheduler(num_blocks=32, budget=32, threshold=0, max_num_seqs=8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 4, enable_prefix_cache=False), max_num_seqs, budget, threshold)


def test_admits_has_the_last_word_and_a_refusal_takes_nothing():
    s = _scheduler()
    for i, (rid, n) in enumerate((("a", 8), ("b", 8), ("c", 4))):
        s.add(_seq(rid, n, i))
    asked = []

    def admits(seq):
        asked.append(seq.request_id)
        return seq.request_id != "b"

    got = s.schedule_prompts(admits=admits)
    assert [q.request_id for q in got] == ["a"] and asked == ["a", "b"]  # b refused: admission stops there
    assert [q.request_id for q in s.waiting] == ["b", "c"] and s.waiting[0].block_table == []
    assert s.block_manager.num_free_blocks() == 32 - 2  # only a's two blocks are taken
    assert s.seqs["a"].status is Status.RUNNING and s.seqs["a"].num_new == 8


def test_prompts_part_way_go_first_and_in_flight_or_decode_rows_get_nothing():
    s = _scheduler(budget=16)
    for i, (rid, n, prio) in enumerate((("long", 40, 0.0), ("late", 4, 2.0), ("urgent", 4, 1.0))):
        s.add(_seq(rid, n, i, prio))
    assert [q.request_id for q in s.waiting] == ["long", "urgent", "late"]  # priority, then arrival
    first = s.schedule_prompts()
    assert [(q.request_id, q.num_new) for q in first] == [("long", 16)]  # the whole budget: a chunk
    long = first[0]
    long.num_computed, long.num_new = 16, 0  # sent (the pipeline moves num_computed on when it sends)
    second = s.schedule_prompts()
    assert [(q.request_id, q.num_new) for q in second] == [("long", 16)]  # its next chunk before anyone waiting
    long.num_computed, long.num_new = 32, 0
    third = s.schedule_prompts()
    assert [(q.request_id, q.num_computed, q.num_new) for q in third] == [("long", 32, 8), ("urgent", 0, 4),
                                                                         ("late", 0, 4)]
    long.num_computed = 40  # its last span in flight: nothing more for it
    for q in third[1:]:
        q.num_computed = q.num_tokens - 1  # decode rows now (one token left): not prompt work
    assert s.schedule_prompts() == []


def test_schedule_is_decode_rows_then_the_same_prompt_work():
    s = _scheduler(budget=8)
    d = _seq("d", 4, 0)
    s.add(d)
    assert s.schedule() == [d]
    d.num_computed = 4
    d.append_output(7)  # a decode row now
    s.add(_seq("p", 12, 1))
    step = s.schedule()
    # the decode row takes one token of the 8: the prompt's chunk is what is left (7), cut to a block boundary
    assert [(q.request_id, q.num_new) for q in step] == [("p", 4), ("d", 1)]


def _solo(solo, budget=64, threshold=16) -> Scheduler:
    return Scheduler(BlockManager(64, 4, enable_prefix_cache=False), 8, budget, threshold, solo_prompt_tokens=solo)


def test_solo_prompts_run_one_per_step_unless_together_within_the_bound():
    s = _solo(8)
    for i, (rid, n) in enumerate((("a", 12), ("b", 4), ("c", 4))):
        s.add(_seq(rid, n, i))
    step = s.schedule_prompts()
    assert [(q.request_id, q.num_new) for q in step] == [("a", 12)]  # b would make it 16 > 8: it waits its turn
    assert [q.request_id for q in s.waiting] == ["b", "c"] and s.waiting[0].block_table == []
    a = step[0]
    a.num_computed, a.num_new = 12, 0
    a.append_output(5)  # a decode row now
    step = s.schedule_prompts()
    assert [(q.request_id, q.num_new) for q in step] == [("b", 4), ("c", 4)]  # 4 + 4 <= 8: tiny prompts share
    off = _solo(0)
    for i, (rid, n) in enumerate((("a", 12), ("b", 4), ("c", 4))):
        off.add(_seq(rid, n, i))
    assert [q.request_id for q in off.schedule_prompts()] == ["a", "b", "c"]  # 0: they share up to the budget


def test_a_short_prompt_passes_a_long_one_part_way_in_a_step_of_its_own():
    s = _solo(8)
    s.add(_seq("long", 200, 0))
    first = s.schedule_prompts()
    assert [(q.request_id, q.num_new) for q in first] == [("long", 64)]  # alone: the whole budget
    long = first[0]
    long.num_computed, long.num_new = 64, 0
    s.add(_seq("short", 6, 1))
    step = s.schedule_prompts()
    assert [(q.request_id, q.num_new) for q in step] == [("short", 6)]  # the long one sits this step out
    assert long.num_new == 0 and long.num_computed == 64
    short = step[0]
    short.num_computed, short.num_new = 6, 0
    short.append_output(5)
    step = s.schedule_prompts()
    assert [(q.request_id, q.num_new) for q in step] == [("long", 64)]  # nobody waits: the whole budget again


def test_a_long_prompt_goes_on_when_the_short_one_cannot_be_admitted():
    s = Scheduler(BlockManager(52, 4, enable_prefix_cache=False), 8, 64, 16, solo_prompt_tokens=8)
    s.add(_seq("long", 200, 0))
    long = s.schedule_prompts()[0]
    long.num_computed, long.num_new = 64, 0
    s.add(_seq("short", 12, 1))  # 3 blocks: only 2 are free (the long one holds 50)
    step = s.schedule_prompts()
    assert [(q.request_id, q.num_new) for q in step] == [("long", 16)]  # its chunk, cut while the short one waits
    assert [q.request_id for q in s.waiting] == ["short"] and s.block_manager.num_free_blocks() == 2
