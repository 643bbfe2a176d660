"""tools/bench_tools/compare.py's pure parts (inference-perf, aiperf and `vllm bench serve` beside pdserve
bench): the word-level bench model for aiperf's corpus, the shared-prefix trace's Poisson arrivals, the server's
own means that take each run's load out of the comparison, and vllm bench serve's trace command and report.
No tool environment is needed."""

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "bench_tools" / "compare.py"


@pytest.fixture(scope="module")
def compare():
    """compare.py as a module; it imports its siblings (tool_reports, tool_tokenizers) as its own folder's."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("bench_tools_compare", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(SCRIPT.parent))


def made_up_model(folder: Path, n: int = 12) -> Path:
    """A bench model's files: a WordLevel tokenizer over t0..t{n-3}, <unk> and an end token (special)."""
    vocab = {f"t{i}": i for i in range(n - 2)} | {"<unk>": n - 2, "<|endoftext|>": n - 1}
    added = [{"id": n - 2, "content": "<unk>", "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True},
             {"id": n - 1, "content": "<|endoftext|>", "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True}]
    doc = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
           "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
           "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}}
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(doc))
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


def test_the_word_model_takes_the_corpus_words_keeps_ids_and_specials_and_links_the_weights(compare, tmp_path):
    from tokenizers import Tokenizer

    source = made_up_model(tmp_path / "src")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the king the king the queen, a rose by any other name " * 3 + "rare")
    dest = compare.word_model(source, tmp_path / "out", corpus)
    doc = json.loads((dest / "tokenizer.json").read_text())
    vocab = doc["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(12))  # the same ids: the weights' rows mean the same slots
    assert vocab["the"] == 0 and vocab["king"] == 1 and vocab["<unk>"] == 10 and vocab["<|endoftext|>"] == 11
    assert "rare" in vocab and "t9" not in vocab  # 10 slots, 10 distinct corpus words: no made-up word left
    assert (dest / "model.safetensors").is_symlink() and (dest / "model.safetensors").read_bytes() == b"weights"
    tok = Tokenizer.from_file(str(dest / "tokenizer.json"))
    ids = tok.encode("the queen, met a stranger").ids
    assert ids[-2:] == [vocab["a"], 10]  # a word outside the vocabulary is <unk> ...
    text = tok.decode(ids)
    assert "<unk>" in text and tok.encode(text).ids == ids  # ... which decodes to text and back: the same length


def test_a_tokenizer_that_is_not_word_level_is_refused(compare, tmp_path):
    source = made_up_model(tmp_path / "src")
    doc = json.loads((source / "tokenizer.json").read_text())
    doc["model"]["type"] = "BPE"
    (source / "tokenizer.json").write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match="not WordLevel"):
        compare.word_model(source, tmp_path / "out", tmp_path / "missing.txt")


def test_the_shared_prefix_trace_arrives_poisson_with_the_runs_seed(compare, tmp_path):
    """inference-perf's `constant` load draws exponential gaps, so pdserve bench's side does too: the same
    seed gives the same arrivals, gaps vary, their mean is 1 / rate; groups share their system blocks."""
    one = [json.loads(x) for x in compare.shared_prefix_trace(tmp_path / "a.jsonl", 7).read_text().splitlines()]
    same = [json.loads(x) for x in compare.shared_prefix_trace(tmp_path / "b.jsonl", 7).read_text().splitlines()]
    other = [json.loads(x) for x in compare.shared_prefix_trace(tmp_path / "c.jsonl", 8).read_text().splitlines()]
    assert one == same and one != other
    shared = compare.SHARED
    assert len(one) == shared["groups"] * shared["per_group"]
    gaps = [(b["timestamp"] - a["timestamp"]) / 1000 for a, b in zip(one, one[1:])]
    assert len(set(gaps)) > len(gaps) // 2  # not evenly spaced
    assert statistics.fmean(gaps) == pytest.approx(1 / shared["rate"], rel=0.35)
    per_system = shared["system"] // shared["question"]
    first, second = one[0]["hash_ids"], one[1]["hash_ids"]
    assert first[:per_system] == second[:per_system] and first[-1] != second[-1]
    assert one[-1]["hash_ids"][:per_system] != first[:per_system]  # another group, another system prompt


def test_the_servers_means_and_the_comparison_net_of_load(compare):
    ttft, gap = sys.modules["tool_reports"].SERVER_SERIES
    before = {ttft: (1.0, 10.0), gap: (0.5, 100.0)}
    after = {ttft: (4.0, 20.0), gap: (1.5, 200.0)}
    assert compare.server_means(before, after) == {"ttft_ms_mean": 300.0, "gap_ms_mean": 10.0}
    assert compare.server_means(None, after) is None
    assert compare.server_means(before, before) == {"ttft_ms_mean": None, "gap_ms_mean": None}

    def run(side, rnd, ttft_ms, tpot_ms, server_ttft, server_gap):
        return {"workload": "w", "side": side, "round": rnd, "requests": 10, "failed": 0,
                "ttft_ms": {"mean": ttft_ms, "p50": ttft_ms}, "tpot_ms": {"mean": tpot_ms, "p50": tpot_ms},
                "server": {"ttft_ms_mean": server_ttft, "gap_ms_mean": server_gap}}

    # the tool's run met a burst (the server saw 1.5x the TTFT): raw 1.53x, net of load 1.02x
    runs = [run("pdserve", 1, 101.0, 10.1, 100.0, 10.0), run("tool", 1, 154.5, 10.0, 150.0, 10.0)]
    table = compare.summary_table(runs)
    assert "| w | 1 | 101.00 / 101.00 | 154.50 / 154.50 | 1.53 / 1.53 |" in table
    assert "| w | 1.010, 1.030 | 1.02 | 1.010, 1.000 | 0.99 |" in table
    runs[1]["server"] = None  # no server figures (not a pdserve): no such table
    assert "Net of load" not in compare.summary_table(runs)


def test_the_word_models_source_is_a_directory_or_a_bench_size_and_anything_else_is_named(compare, tmp_path):
    source = made_up_model(tmp_path / "src")
    assert compare.bench_checkpoint(str(source)) == source.resolve()
    with pytest.raises(SystemExit, match="neither a model directory with a tokenizer.json nor one of peer, small"):
        compare.bench_checkpoint(str(tmp_path / "nothing"))


def test_vllm_bench_serve_replays_the_trace_window_and_its_report_is_read_back(compare, tmp_path):
    files = {"model": "tiny", "tokenizer_dir": tmp_path / "tok", "mooncake_file": tmp_path / "w.jsonl", "mooncake_n": 7}
    cmd = compare.vllm_bench_cmd(Path("/v/python"), "http://h:1", tmp_path, 9, files)
    assert cmd[:3] == ["/v/python", "-c", compare.VLLM_BENCH]
    args = dict(zip(cmd[3::2], cmd[4::2]))
    # a hash id is as many tokens as pdserve bench's side makes of it; timestamps are the trace's milliseconds
    assert args["--dataset-name"] == "timed_trace" and args["--timed-trace-chunk-hash-size"] == "16"
    assert args["--timed-trace-sec-multiplier"] == "0.001" and args["--num-prompts"] == "7"
    assert "--save-detailed" in cmd and args["--result-filename"] == "result.json"
    doc = {"completed": 3, "failed": 1, "total_input_tokens": 300, "total_output_tokens": 33, "mean_ttft_ms": 200.0,
           "median_ttft_ms": 180.0, "mean_tpot_ms": 9.0, "median_tpot_ms": 8.0, "errors": ["", "", "", "boom"],
           "duration": 10.0}
    (tmp_path / "result.json").write_text(json.dumps(doc))
    got = compare.read_vllm_bench(tmp_path / "result.json")
    assert (got["requests"], got["failed"], got["errors"]) == (4, 1, ["boom"])
    assert got["server_prompt_tokens_mean"] == 100 and got["server_output_tokens_mean"] == 11
    assert got["ttft_ms"] == {"mean": 200.0, "p50": 180.0} and got["tpot_ms"] == {"mean": 9.0, "p50": 8.0}
