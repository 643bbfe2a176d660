"""pdserve/thread_cpu.py: each thread's CPU clock, named, and the difference of two snapshots."""

import threading
import time

import pytest

from pdserve import thread_cpu

SPIN_CPU_S = 0.05
TICK_S = 0.011


def _spin_then_wait(spun: threading.Event, release: threading.Event) -> None:
    """Burn SPIN_CPU_S of this thread's CPU clock (a condition on the clock, not on wall time), then wait."""
    while time.thread_time() < SPIN_CPU_S:
        sum(range(1000))
    spun.set()
    release.wait(60)  # hang guard only: the test releases it


def test_a_spinning_thread_shows_under_its_name_and_in_the_delta():
    before = thread_cpu.snapshot()
    spun, release = threading.Event(), threading.Event()
    t = threading.Thread(target=_spin_then_wait, args=(spun, release), name="spin-test", daemon=True)
    t.start()
    try:
        assert spun.wait(60)
        after = thread_cpu.snapshot()
        rows = [r for r in after["threads"] if r["name"] == "spin-test"]
        # /proc counts whole clock ticks (10 ms): up to one tick below the thread's own clock
        assert len(rows) == 1 and rows[0]["cpu_s"] >= SPIN_CPU_S - TICK_S and rows[0]["native_id"] == t.native_id

        assert after["threads"] == sorted(after["threads"], key=lambda r: -r["cpu_s"])
        assert after["process_cpu_s"] >= sum(r["cpu_s"] for r in after["threads"]) - TICK_S * len(after["threads"])
        delta = thread_cpu.by_name_delta(before, after)
        assert delta["spin-test"] >= SPIN_CPU_S - TICK_S, delta  # it started in between: counted whole
    finally:
        release.set()
        t.join(60)


def test_threads_of_one_name_are_summed():
    before = {"process_cpu_s": 1.0, "other_cpu_s": 0.5,
              "threads": [{"name": "w", "native_id": 1, "cpu_s": 0.2}, {"name": "w", "native_id": 2, "cpu_s": 0.3}]}
    after = {"process_cpu_s": 2.0, "other_cpu_s": 0.6,
             "threads": [{"name": "w", "native_id": 1, "cpu_s": 0.5}, {"name": "w", "native_id": 2, "cpu_s": 0.4},
                         {"name": "new", "native_id": 3, "cpu_s": 0.25}]}
    delta = thread_cpu.by_name_delta(before, after)
    assert delta["w"] == pytest.approx(0.4) and delta["new"] == pytest.approx(0.25)
    assert delta["(other threads)"] == pytest.approx(0.1)


def test_a_thread_that_is_gone_is_skipped():
    assert thread_cpu._task_cpu_s(2**22 + 12345) is None and thread_cpu._task_cpu_s(None) is None
