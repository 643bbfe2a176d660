"""bench chaos: the outcome of a request from its byte timeline, and the summary over outcomes."""

import pytest

from pdserve.bench.chaos.faults import Fault
from pdserve.bench.chaos.outcome import UNCLEAR_PREFIX, RequestRecord, classify, longest_silence, overlaps
from pdserve.bench.chaos.report import summarize


def rec(byte_times, end, text="abc", finished=True, error="", checked=True, start=0.0, index=0):
    return RequestRecord(index, 0, checked, start=start, end=end, byte_times=list(byte_times), text=text,
                         finished=finished, error=error)


def test_a_finished_stream_with_the_reference_text_completed():
    assert classify(rec([0.2, 0.3, 0.4], 0.4), hang_s=30, reference="abc") == "completed"


def test_a_greedy_stream_with_other_text_is_wrong_but_a_sampled_one_is_not_checked():
    assert classify(rec([0.2], 0.3, text="abd"), hang_s=30, reference="abc") == "wrong"
    assert classify(rec([0.2], 0.3, text="abd", checked=False), hang_s=30, reference=None) == "completed"


def test_a_long_silence_anywhere_is_a_hang():
    assert classify(rec([31.0, 31.1], 31.2), hang_s=30, reference="abc") == "hung"          # before the first byte
    assert classify(rec([0.1, 40.0], 40.1), hang_s=30, reference="abc") == "hung"           # between bytes
    r = rec([0.1, 0.2], 31.5, finished=False, error="no byte for 31s")
    assert classify(r, hang_s=30, reference="abc") == "hung"                                 # after the last byte
    assert longest_silence(r) == pytest.approx(31.3)


def test_clear_errors_fail_and_silent_ends_are_cut():
    assert classify(rec([0.1], 0.2, finished=False, error="error event: decode failed"), 30, "abc") == "failed"
    assert (classify(rec([], 0.01, finished=False, error="connection: ClientConnectorError: refused"), 30, "abc")
            == "failed")
    assert classify(rec([0.1], 0.2, finished=False, error=f"{UNCLEAR_PREFIX} no [DONE]"), 30, "abc") == "cut"
    assert classify(rec([0.1], 0.2, finished=False, error=""), 30, "abc") == "cut"


def test_a_request_still_running_cannot_be_classified():
    with pytest.raises(ValueError, match="not ended"):
        classify(rec([0.1], None), 30, "abc")


def test_overlap_with_outages():
    r = rec([1.0], 2.0, start=1.0)
    assert overlaps(r, [(1.5, 9.0)]) and overlaps(r, [(0.0, 1.0)])
    assert not overlaps(r, [(2.5, 3.0)])


def test_summary_leaves_requests_during_a_prefill_outage_out_of_the_serving_percentage():
    records = [rec([0.5], 1.0, start=0.0, index=0),
               rec([], 5.1, start=5.0, finished=False, error="connection: reset", index=1),
               rec([9.5], 10.0, start=9.0, index=2)]
    for r, o in zip(records, ("completed", "failed", "completed")):
        r.outcome = o
    faults = [Fault(4.0, "kill-prefill", "prefill-0", 1, recovered_at=8.0), Fault(6.0, "kill-decode", "decode-0", 2)]
    s = summarize(records, faults, leaked={}, horizon=12.0)
    assert s["completed"] == 2 and s["failed"] == 1 and s["leaked"] == 0
    assert s["completed_pct"] == pytest.approx(200 / 3)
    assert s["requests_while_serving"] == 2 and s["completed_pct_serving"] == 100.0
    assert s["faults"] == {"kill-decode": 1, "kill-prefill": 1}


def test_the_verdict_is_over_every_request_behind_a_router():
    """Issue 32: with two prefills behind the router the target is >= 99.9% of EVERY request sent (and
    0 cut, hung, wrong, leaked); with one prefill (no router) the rate is over the requests that met no
    prefill outage, and the line says so."""
    from pdserve.bench.chaos.report import verdict

    s = {"requests": 1000, "completed": 999, "failed": 1, "cut": 0, "hung": 0, "wrong": 0,
         "completed_pct": 99.9, "completed_pct_serving": 100.0}
    assert verdict(s, 2, False)[0] and "of every request sent" in verdict(s, 2, False)[1]
    low = {**s, "completed": 980, "failed": 20, "completed_pct": 98.0}
    ok, line = verdict(low, 2, False)
    assert not ok and "98.00% completed of every request sent < 99.9%" in line
    assert verdict(low, 1, False)[0] and "no prefill outage" in verdict(low, 1, False)[1]
    assert not verdict({**s, "cut": 1}, 2, False)[0] and "cut 1" in verdict({**s, "cut": 1}, 2, False)[1]
    assert not verdict(s, 2, True)[0]


def test_the_fault_loop_keeps_one_prefill_serving_where_there_are_two(tmp_path):
    """With two prefills behind the router a prefill fault never takes the last one serving (the other
    is restarting here); a single prefill, the front door itself, may still be hit."""
    import json
    import random
    import subprocess
    import time

    from pdserve.bench.chaos.faults import FaultLoop

    victim = subprocess.Popen(["sleep", "60"])
    try:
        state = tmp_path / "servers.json"
        loop = FaultLoop(state, random.Random(0), 1.0, (1, 2), ("kill-prefill",), time.perf_counter(),
                         say=lambda *_: None)
        state.write_text(json.dumps({"prefill-0": {"state": "ready", "pid": victim.pid},
                                     "prefill-1": {"state": "starting", "pid": 0}}))
        loop._inject()
        assert loop.faults == [] and victim.poll() is None
        state.write_text(json.dumps({"prefill-0": {"state": "ready", "pid": victim.pid}}))
        loop._inject()
        assert [(f.kind, f.target) for f in loop.faults] == [("kill-prefill", "prefill-0")]
        assert victim.wait(10) == -9
    finally:
        victim.kill()
        victim.wait()
