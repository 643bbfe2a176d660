"""bench/tools/step_causes.py: the slowest steps of a step trace, by their batch size's median, split by cause."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("step_causes", REPO / "bench" / "tools" / "step_causes.py")
step_causes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(step_causes)


def _step(seconds, rows=1, **kw):
    rec = {"t": 0.0, "seconds": seconds, "gap_s": 0.001, "rows": rows, "chunk_tokens": 0, "ctx_tokens": 500 * rows,
           "joined": 0, "new_rows": False, "calls": 0, "calls_s": 0.0, "gc": [], "engine_cpu_s": seconds,
           "loop_cpu_s": 0.0, "other_cpu_s": 0.0, "wait_s": 0.0, "faults": 0, "pending": 0, "waiting_join": 0,
           "kv_bytes": 0.0}
    rec.update(kw)
    return rec


def test_the_slowest_steps_by_their_batch_size_are_split_by_cause(tmp_path):
    steps = [_step(0.040) for _ in range(150)] + [_step(0.060, rows=2) for _ in range(150)]
    steps[10] = _step(0.120, gc=[[2, 0.07]])  # a full collection in it
    steps[20] = _step(0.090, joined=1, faults=9000)  # a request joined, its KV pages first touched
    steps[200] = _step(0.100, rows=2, wait_s=0.04)  # another process had the core
    steps.append(_step(0.070, rows=2, chunk_tokens=512))  # a prompt chunk: not a decode step, left out
    out = step_causes.analyse(steps, top=0.01, share=0.1)
    assert out["decode_steps"] == 300 and out["slow_steps"] == 3
    assert [s["causes"] for s in out["slowest"]] == [["gc2"], ["join", "faults"], ["wait"]]  # 3.0x, 2.2x, 1.7x
    assert out["causes"]["gc2"] == {"slow": 1, "slow_frac": 0.333, "all": 1, "all_frac": 0.003}
    assert out["causes"]["none"]["slow"] == 0 and out["causes"]["none"]["all"] == 297


def test_a_joining_step_counts_its_join_and_not_its_gap():
    only_new = _step(0.040, joined=1, gap_s=5.0)  # after idle: the gap is no request's time between tokens
    assert step_causes.interval(only_new) == 0.040 and "join" in step_causes.causes(only_new, 0.04, 0.1)
    one_of_two = _step(0.050, rows=2, joined=1, gap_s=0.010)  # the other request waited the gap too
    assert step_causes.interval(one_of_two) == pytest.approx(0.060)


def test_the_command_prints_and_writes_the_analysis(tmp_path, capsys):
    trace = tmp_path / "steps.jsonl"
    trace.write_text("".join(json.dumps(_step(0.04 + i / 1000)) + "\n" for i in range(100)))
    assert step_causes.main([str(trace), "--json", str(tmp_path / "out.json")]) == 0
    assert "slowest 1 (1%)" in capsys.readouterr().out
    assert json.loads((tmp_path / "out.json").read_text())["decode_steps"] == 100
    (tmp_path / "empty.jsonl").write_text("")
    assert step_causes.main([str(tmp_path / "empty.jsonl")]) == 2
