"""bench/provenance.py: every figure names the machine and the day of its run (issue 33 item 5), and every result
JSON the record of its run's start, written in one place (issue 52 item 4)."""

import argparse
import ast
import gzip
import json
from pathlib import Path

from pdserve import bench
from pdserve.bench import provenance
from pdserve.bench.experiments import report, trace_routing_figures
from pdserve.bench.experiments.peer_report import run_figures
from pdserve.bench.loadgen_report import RequestResult, summarize
from pdserve.bench.provenance import machine, save_figure, stamp

RUN = {"cpu_model": "AMD EPYC", "cpus": 2, "utc": "2026-11-29T04:10:00Z", "git_commit": "abc1234"}


def test_the_stamp_names_cpu_day_and_commit_and_leaves_out_what_is_missing():
    assert stamp(RUN) == "AMD EPYC (2 CPUs) · 2026-11-29 · commit abc1234"
    assert stamp({"utc": "2026-11-29T04:10:00Z"}) == "CPU not recorded · 2026-11-29"
    here = machine()
    assert here["utc"][:10] in stamp(here) and str(here["cpus"]) in stamp(here)


def test_a_saved_figure_carries_the_runs_stamp_not_the_drawing_machines(tmp_path):
    plt = report.pyplot()
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    path = save_figure(fig, tmp_path / "sub" / "f.png", record=RUN)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [t.get_text() for t in fig.texts] == [stamp(RUN)]


def test_without_a_record_the_stamp_is_this_machine_now(tmp_path):
    plt = report.pyplot()
    fig, _ = plt.subplots()
    save_figure(fig, tmp_path / "f.png")
    (text,) = [t.get_text() for t in fig.texts]
    assert text.startswith(machine()["cpu_model"] or "CPU not recorded") and machine()["utc"][:10] in text


# Issue 52 item 4: every result JSON records where its run began, written in one place.
BENCH = Path(__file__).resolve().parents[2] / "bench"
NOT_RESULTS = {  # JSON the package writes that is no benchmark result, and why (provenance.write_json: results)
    "experiments/client.py": "the client process's input and output files, read back by the experiment",
    "experiments/peer_model.py": "the bench checkpoint's tokenizer config",
}


def test_the_start_record_names_load_cpu_commit_and_a_dirty_flag():
    provenance.run_start.cache_clear()
    rec = provenance.run_start()
    assert rec["taken"] == "at the start of the run" and provenance.run_start() is rec  # taken once
    assert len(rec["load_avg"]) == 3 and all(x >= 0 for x in rec["load_avg"])
    assert rec["cpu_model"] and rec["cpus"] >= 1  # lscpu, else /proc/cpuinfo: a Linux box names its CPU
    assert len(rec["git_commit"]) >= 7 and isinstance(rec["git_dirty"], bool)  # the tests run in a checkout
    assert rec["utc"].endswith("Z")


def test_pdserve_bench_takes_the_record_before_the_benchmark_runs(monkeypatch):
    provenance.run_start.cache_clear()
    seen = []
    monkeypatch.setattr(bench, "_run_bench", lambda args: seen.append(provenance.run_start.cache_info().currsize))
    bench.run(argparse.Namespace(name="slo-policy", rest=[]))
    assert seen == [1]


def test_a_result_carries_the_start_record_first_and_is_gzipped_when_large(tmp_path, monkeypatch):
    provenance.run_start.cache_clear()
    start = provenance.run_start()
    path = provenance.write_json(tmp_path / "sub" / "r.json", {"figures": {"a": 1}, "requests": [{"ttft": 0.1}]})
    doc = json.loads(path.read_text())
    assert list(doc)[:2] == ["provenance", "figures"] and doc["provenance"] == start
    assert doc["requests"] == [{"ttft": 0.1}]  # per-request records kept as given
    monkeypatch.setattr(provenance, "GZIP_ABOVE_BYTES", 100)
    big = provenance.write_json(tmp_path / "big.json", {"requests": [{"ttft": i} for i in range(50)]})
    assert big.name == "big.json.gz" and json.loads(gzip.decompress(big.read_bytes()))["provenance"] == start


def test_a_run_that_did_not_record_its_start_says_so(tmp_path):
    provenance.run_start.cache_clear()
    doc = json.loads(provenance.write_json(tmp_path / "r.json", {}).read_text())
    assert doc["provenance"]["taken"].startswith("when the result was written")
    assert provenance.run_start.cache_info().currsize == 0  # a later start record is still its own


def test_the_peer_and_trace_routing_experiments_keep_every_requests_record():
    ok = RequestResult(0, prompt_tokens=8, output_tokens=2, ok=True, ttft=0.1, e2e=0.2, gaps=[0.1])
    failed = RequestResult(1, prompt_tokens=8, output_tokens=2, ok=False, error="HTTP 500: boom")
    records = [ok.to_json(), failed.to_json()]
    assert run_figures(summarize([ok, failed], 1.0), [ok, failed])["per_request"] == records
    assert trace_routing_figures.run_figures([ok, failed], 1.0, {}, 2.0, 0.1)["per_request"] == records


def _writes_json(tree: ast.AST) -> bool:
    """A call of json.dump, or json.dumps handed straight to a write_text / write."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "dump" and getattr(node.func.value, "id", None) == "json":
                return True
            if node.func.attr in ("write_text", "write") and any(
                    isinstance(a, ast.Call) and isinstance(a.func, ast.Attribute) and a.func.attr == "dumps"
                    for a in node.args):
                return True
    return False


def test_results_are_written_in_one_place():
    writers = sorted(str(f.relative_to(BENCH)) for f in BENCH.rglob("*.py")
                     if "tools" not in f.parts and _writes_json(ast.parse(f.read_text())))
    assert writers == sorted(NOT_RESULTS), "write a result with bench/provenance.write_json (it records the start)"
