"""bench conformance: verdicts, the report, the command line's checks and the pure judges (no server)."""

import asyncio
import json

import pytest

from pdserve.bench.conformance import parse_kill_cmds, validate
from pdserve.bench.conformance.bad_input import error_shape
from pdserve.bench.conformance.cancellation import parse_in_flight
from pdserve.bench.conformance.correctness import pick_stop
from pdserve.bench.conformance.faults import classify
from pdserve.bench.conformance.report import document, format_markdown, format_table, write_json
from pdserve.bench.conformance.runner import Check, Context, build_checks, run_check
from pdserve.bench.conformance.verdict import FAIL, PASS, SKIP, Outcome, Problems, Result, exit_status, summary
from pdserve.bench.conformance.wire import Endpoint, StreamReply


def test_problems_pass_with_notes_and_fail_naming_the_first_few():
    p = Problems()
    p.note("a deviation within what is accepted")
    assert p.outcome("all good").verdict == PASS and "note: a deviation" in p.outcome("all good").detail
    for i in range(5):
        p.check(False, f"problem {i}")
    out = p.outcome("all good")
    assert out.verdict == FAIL
    assert "problem 0; problem 1; problem 2" in out.detail and "(+2 more)" in out.detail
    assert out.data["problems"] == [f"problem {i}" for i in range(5)]
    with pytest.raises(ValueError):
        Outcome("MAYBE", "")


def test_summary_and_exit_status():
    rows = [Result("a", "x", PASS, ""), Result("b", "x", SKIP, ""), Result("c", "y", FAIL, "broke")]
    assert summary(rows) == {"pass": 1, "fail": 1, "skip": 1, "total": 3, "failed_checks": ["c"]}
    assert exit_status(rows) == 1
    assert exit_status(rows[:2]) == 0


def test_table_markdown_and_json(tmp_path):
    rows = [Result("greedy.chat", "correctness", PASS, "9/9 | equal " + "x" * 300, 1.25, {"equal": 9}),
            Result("bad-input.absurd-n", "bad-input", FAIL, "HTTP 500, not 4xx", 0.01)]
    table = format_table(rows)
    assert "greedy.chat" in table and "FAIL" in table and table.endswith("1 passed, 1 failed, 0 skipped of 2 checks")
    assert max(len(line) for line in table.splitlines()) < 200  # the detail is cut to fit
    md = format_markdown(rows)
    assert md.splitlines()[0] == "| area | check | verdict | time | detail |" and "9/9 \\| equal" in md
    path = write_json(tmp_path / "out" / "c.json", rows, {"url": "http://x"})
    doc = json.loads(path.read_text())
    assert doc.pop("provenance")["git_commit"]  # bench/provenance.write_json: the run's start record first
    assert doc == json.loads(json.dumps(document(rows, {"url": "http://x"})))
    assert doc["config"] == {"url": "http://x"} and doc["summary"]["failed_checks"] == ["bad-input.absurd-n"]
    assert doc["checks"][0]["detail"].endswith("x" * 300)  # the JSON keeps the whole detail
    assert {c["name"]: c["verdict"] for c in doc["checks"]} == {"greedy.chat": PASS, "bad-input.absurd-n": FAIL}


def _ctx(**kw) -> Context:
    return Context(Endpoint("http://127.0.0.1:9/v1", model="m"), **kw)


def test_a_check_that_raises_or_hangs_fails_and_the_run_goes_on():
    async def raises(ctx):
        raise KeyError("boom")

    async def hangs(ctx):
        await asyncio.Event().wait()  # never set: only the check's guard ends it

    async def main():
        a = await run_check(_ctx(), Check("raises", "x", raises), 5.0)
        b = await run_check(_ctx(), Check("hangs", "x", hangs), 0.2)
        return a, b

    a, b = asyncio.run(main())
    assert a.verdict == FAIL and "raised KeyError" in a.detail and "traceback" in a.data
    assert b.verdict == FAIL and "hang guard" in b.detail


def test_left_out_areas_and_faults_without_a_kill_command_are_skipped_rows():
    checks = build_checks(_ctx(), ("bad-input", "faults"))
    names = [c.name for c in checks]
    assert "correctness.*" in names and "cancellation.*" in names and "bad-input.missing-model" in names
    outcome = asyncio.run(next(c for c in checks if c.name == "faults.*").run(_ctx()))
    assert outcome.verdict == SKIP and "--kill-cmd" in outcome.detail
    with_kill = [c.name for c in build_checks(_ctx(kill_cmds=[("decode", "true")]), ("faults",))]
    assert with_kill[-2:] == ["faults.kill-decode", "faults.recover-decode"]


def test_endpoint_url_and_command_line_validation():
    assert Endpoint("http://h:1/v1/").url == "http://h:1"
    with pytest.raises(ValueError):
        Endpoint("h:1")
    assert parse_kill_cmds(["decode=kill -9 $(cat d.pid)", "prefill=x=y"]) == [
        ("decode", "kill -9 $(cat d.pid)"), ("prefill", "x=y")]
    for bad in (["decode"], ["=cmd"], ["decode="], ["a b=cmd"], ["d=x", "d=y"]):
        with pytest.raises(ValueError):
            parse_kill_cmds(bad)

    import argparse

    from pdserve.bench.conformance import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--url", "http://h:1", "--areas", "faults,correctness", "--lengths", "2,8"])
    assert validate(args) == (("faults", "correctness"), (2, 8), [])
    for argv in (["--areas", "speed"], ["--lengths", "0"], ["--lengths", "a"], ["--hang-s", "0"],
                 ["--fault-after-tokens", "300"]):
        with pytest.raises(ValueError):
            validate(parser.parse_args(["--url", "http://h:1", *argv]))


def test_openai_error_shape():
    assert error_shape({"error": {"message": "m", "type": "t", "param": None, "code": None}}) == ([], [])
    assert error_shape({"error": {"message": "m", "type": "t"}}) == ([], ["error has no param, code key"])
    assert error_shape({"object": "error", "message": "m"})[0]  # vLLM's old shape: no "error" object
    assert error_shape({"error": "oops"})[0] and error_shape(["x"])[0]
    assert "error.message" in error_shape({"error": {"message": "", "type": "t"}})[0][0]


def test_in_flight_counters_from_a_metrics_page():
    page = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{role="prefill"} 2.0\n'
            'vllm:num_requests_running{role="other"} 1.0\n# TYPE other gauge\nother 7.0\n')
    assert parse_in_flight(page) == {"vllm:num_requests_running": 3.0}
    assert parse_in_flight("not a metrics page {{{") == {}
    assert parse_in_flight("# TYPE other gauge\nother 7.0\n") == {}


def test_stop_string_choice():
    assert pick_stop("abcdefghij") == ("def", 3)
    text = "abcabcabcabc"
    s, at = pick_stop(text)
    assert text.find(s) == at >= 1                 # the first occurrence, never at 0
    assert pick_stop("ab") is None
    assert pick_stop("\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd") is None


def _stream(**kw) -> StreamReply:
    s = StreamReply(status=200, ended=True)
    for k, v in kw.items():
        setattr(s, k, v)
    return s


def test_fault_outcomes():
    ok = [{"choices": [{"index": 0, "text": "ab", "finish_reason": None}]},
          {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}]
    assert classify(_stream(events=ok, done_count=1), "ab") == "completed"
    assert classify(_stream(events=ok, done_count=1), "ax") == "wrong"
    assert classify(_stream(events=ok, done_count=1, hung=True, error="hang guard"), "ab") == "hung"
    assert classify(_stream(status=503), "ab") == "http-error"
    assert classify(_stream(status=0, error="transport: refused"), "ab") == "http-error"
    err = [ok[0], {"error": {"message": "decode_failed"}}]
    assert classify(_stream(events=err, done_count=1), "ab") == "error-event"
    assert classify(_stream(events=ok[:1], error="transport: ClientPayloadError", ended=False), "ab") == "broken"
    assert classify(_stream(events=ok[:1], done_count=0), "ab") == "cut"      # a clean end that says nothing
    assert classify(_stream(events=ok[:1], done_count=1), "ab") == "cut"      # [DONE] without a finish_reason
