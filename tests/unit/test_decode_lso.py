"""LSO eviction decisions (decode_server/lso.py ``decide``), as pure logic."""

from pdserve.decode_server.lso import Decision, Hint, decide

I = Hint(0.050, False)   # interactive: TBT 50 ms
B = Hint(None, True)     # batch: evictable


def test_evicts_the_newest_batch_request_when_a_step_misses_the_tightest_tbt():
    running = [("b1", B), ("i1", I), ("b2", B), ("x", None), ("i2", Hint(0.030, False))]
    assert decide(0.040, running, [], steps_since_evict=10) == Decision("evict", "b2")  # 40 ms > 30 ms
    assert decide(0.020, running, [], steps_since_evict=10) is None  # every target is met
    assert decide(0.040, running, [], steps_since_evict=1) is None  # the EWMA has not seen the smaller batch yet


def test_nothing_to_protect_or_nothing_to_evict():
    assert decide(1.0, [("b1", B), ("x", None)], [], 10) is None  # no TBT target runs
    assert decide(1.0, [("i1", I), ("x", None)], [], 10) is None  # untracked requests are never evicted
    assert decide(None, [("i1", I), ("b1", B)], [], 10) is None  # no step measured yet


def test_restores_the_first_evicted_when_it_fits_the_target_again():
    # 2 running at 20 ms a step: 3 would take ~30 ms, under 0.7 x 50 ms
    assert decide(0.020, [("i1", I), ("b1", B)], ["b2", "b3"], 10) == Decision("restore", "b2")
    # 2 running at 30 ms: 3 would take 45 ms > 35 ms: stays swapped
    assert decide(0.030, [("i1", I), ("b1", B)], ["b2"], 10) is None
    # right after an eviction: wait for the cooldown
    assert decide(0.001, [("i1", I)], ["b2"], 2) is None


def test_restores_at_once_when_no_interactive_request_runs():
    assert decide(5.0, [("b1", B)], ["b2"], 10) == Decision("restore", "b2")
    assert decide(None, [], ["b2"], 10) == Decision("restore", "b2")
    assert decide(None, [], [], 10) is None
