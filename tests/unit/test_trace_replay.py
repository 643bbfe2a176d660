"""Trace replay (bench/trace_replay.py): equal hash ids give equal token blocks, the block structure
is kept under length scaling, time scaling and windows, both trace formats with errors that name
the line, and Mooncake's real conversation trace (bench/traces, xz-compressed) read whole."""

import argparse
import gzip
import json
import lzma
from pathlib import Path

import pytest

from pdserve.bench import loadgen, trace_replay
from pdserve.bench.trace_replay import (MOONCAKE_TRACE, TRACE_BLOCK_TOKENS, Scaling, TraceRequest, read_trace,
                                        replay_requests)

POOL = list(range(1, 1000))


def _mooncake(tmp_path, rows) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [
    {"timestamp": 0, "input_length": 1200, "output_length": 40, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": 1100, "output_length": 30, "hash_ids": [0, 1, 3]},
    {"timestamp": 2000, "input_length": 300, "output_length": 10, "hash_ids": [4]},
    {"timestamp": 9000, "input_length": 600, "output_length": 20, "hash_ids": [0, 5]},
]


def test_equal_ids_give_equal_tokens_and_the_structure_survives_scaling(tmp_path):
    reqs = read_trace(_mooncake(tmp_path, ROWS), "mooncake")
    for scale in (1.0, 0.125):
        specs, _ = replay_requests(reqs, Scaling(length_scale=scale), POOL, seed=7)
        bt = Scaling(length_scale=scale).block_tokens
        assert bt == round(TRACE_BLOCK_TOKENS * scale)
        a, b, c, d = (s.prompt_ids for s in specs)
        assert len(a) == round(1200 * scale) and specs[0].output_tokens == round(40 * scale)
        assert a[: 2 * bt] == b[: 2 * bt]  # ids 0, 1 shared
        assert a[2 * bt: 3 * bt] != b[2 * bt: 3 * bt]  # id 2 vs id 3
        assert a[:bt] == d[:bt] and a[bt: 2 * bt] != d[bt: 2 * bt]  # id 0 shared, then 1 vs 5
        assert c[:bt] != a[:bt]
        assert all(t in POOL for s in specs for t in s.prompt_ids)
    again, _ = replay_requests(reqs, Scaling(length_scale=0.125), POOL, seed=7)
    assert again == replay_requests(reqs, Scaling(length_scale=0.125), POOL, seed=7)[0]  # deterministic per seed
    other, _ = replay_requests(reqs, Scaling(length_scale=0.125), POOL, seed=8)
    assert other[0].prompt_ids != again[0].prompt_ids


def test_time_scaling_windows_and_caps(tmp_path):
    reqs = read_trace(_mooncake(tmp_path, ROWS), "mooncake")
    _, arrivals = replay_requests(reqs, Scaling(time_scale=2.0), POOL)
    assert arrivals == [0.0, 1.0, 4.0, 18.0]
    specs, arrivals = replay_requests(reqs, Scaling(start_s=0.5, duration_s=2.0), POOL)
    assert [s.prompt_tokens for s in specs] == [1100, 300] and arrivals == [0.0, 1.5]
    specs, _ = replay_requests(reqs, Scaling(max_requests=3), POOL)
    assert len(specs) == 3
    with pytest.raises(ValueError, match="no request of the trace arrives in its trace window 100s"):
        replay_requests(reqs, Scaling(start_s=100, duration_s=5), POOL)
    assert "time x2" in Scaling(time_scale=2).describe() and "64 tokens" in Scaling(length_scale=0.125).describe()
    specs, _ = replay_requests(reqs, Scaling(max_prompt_tokens=600, max_output_tokens=25), POOL)
    assert ([s.prompt_tokens for s in specs] == [600, 600, 300, 600]
            and [s.output_tokens for s in specs] == [25, 25, 10, 20])
    assert specs[0].prompt_ids[:512] == specs[1].prompt_ids[:512]  # a cut prompt keeps its leading blocks
    assert "prompts cut at 600 tokens; outputs cut at 25 tokens" in Scaling(max_prompt_tokens=600,
                                                                            max_output_tokens=25).describe()


@pytest.mark.parametrize("kw, message", [({"time_scale": 0}, "time scale"), ({"length_scale": 1.5}, "length scale"),
                                         ({"duration_s": 0}, "duration"), ({"max_requests": 0}, "max requests"),
                                         ({"max_prompt_tokens": 0}, "max prompt tokens"),
                                         ({"start_s": -1}, "start")])
def test_bad_scaling_is_named(kw, message):
    with pytest.raises(ValueError, match=message):
        Scaling(**kw)


def test_lengths_past_the_ids_and_traces_without_ids(tmp_path):
    reqs = [TraceRequest(0.0, 700, 5, (9,)), TraceRequest(1.0, 700, 5, (9,))]
    specs, _ = replay_requests(reqs, Scaling(), POOL)
    assert len(specs[0].prompt_ids) == 700
    assert specs[0].prompt_ids[:512] == specs[1].prompt_ids[:512]  # the shared block
    assert specs[0].prompt_ids[512:] != specs[1].prompt_ids[512:]  # each request's own tail


def test_azure_csv_both_headers(tmp_path):
    a = tmp_path / "azure.csv"
    a.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                 "2023-11-16 18:15:50.9951690,396,109\n")
    reqs = read_trace(a, "azure")
    assert [(round(r.time_s, 3), r.input_length, r.output_length, r.hash_ids) for r in reqs] == [
        (0.0, 374, 44, ()), (4.315, 396, 109, ())]
    specs, _ = replay_requests(reqs, Scaling(), POOL)
    assert specs[0].prompt_ids[:32] != specs[1].prompt_ids[:32]  # no ids: no shared prefix
    b = tmp_path / "plain.csv"
    b.write_text("timestamp,input_length,output_length\n10.5,100,20\n10.0,50,5\n")
    assert [(r.time_s, r.input_length) for r in read_trace(b, "azure")] == [(0.0, 50), (0.5, 100)]


@pytest.mark.parametrize("text, fmt, message", [
    ('{"timestamp": 0, "input_length": 10}\n', "mooncake", r"trace.bad:1: output_length must be an integer >= 1"),
    ('{"timestamp": -5, "input_length": 10, "output_length": 3}\n', "mooncake", r"trace.bad:1: timestamp"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": "x"}\n', "mooncake", "hash_ids"),
    ("not json\n", "mooncake", r"trace.bad:1: expected"),
    ("a,b,c\n1,2,3\n", "azure", "the header must name"),
    ("timestamp,input_length,output_length\nnoon,2,3\n", "azure", r"trace.bad:2: timestamp 'noon'"),
    ("timestamp,input_length,output_length\n1,0,3\n", "azure", r"trace.bad:2: input_length must be"),
    ("", "mooncake", "no requests"),
])
def test_bad_traces_name_the_line(tmp_path, text, fmt, message):
    path = tmp_path / "trace.bad"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_trace(path, fmt)
    with pytest.raises(ValueError, match="trace format"):
        read_trace(path, "csv")


def test_the_mooncake_trace_in_the_repository_reads_whole():
    """The real trace shipped in bench/traces (xz): one hour, 12,031 requests, shared prefixes."""
    assert MOONCAKE_TRACE.is_file(), f"{MOONCAKE_TRACE} is missing (bench/traces/README.md says how to rebuild it)"
    reqs = read_trace(MOONCAKE_TRACE, "mooncake")
    assert len(reqs) == 12031 and reqs[-1].time_s < 3700
    specs, arrivals = replay_requests(reqs, Scaling(length_scale=1 / 64, duration_s=60.0), POOL)
    assert arrivals[0] == 0.0 and arrivals[-1] < 60.0 and len(specs) > 50
    firsts = [s.prompt_ids[:8] for s, r in zip(specs, reqs) if r.hash_ids and r.hash_ids[0] == 0]
    assert len(firsts) > 1 and all(f == firsts[0] for f in firsts)  # hash id 0 opens many prompts: one block


def test_compressed_traces_read_as_plain_ones(tmp_path):
    plain = _mooncake(tmp_path, ROWS)
    for suffix, compress in ((".xz", lzma.compress), (".gz", gzip.compress)):
        packed = tmp_path / f"trace.jsonl{suffix}"
        packed.write_bytes(compress(plain.read_bytes()))
        assert read_trace(packed, "mooncake") == read_trace(plain, "mooncake")


def test_bench_serving_takes_a_trace(tmp_path):
    parser = argparse.ArgumentParser()
    loadgen.add_arguments(parser)
    path = _mooncake(tmp_path, ROWS)
    args = parser.parse_args(["--dataset", "mooncake", "--dataset-path", str(path), "--token-ids", "500",
                              "--trace-time-scale", "0.5", "--trace-length-scale", "0.25", "--trace-window", "0:3"])
    specs, arrivals, described = loadgen.trace_from_args(args, 10, 0)
    assert [s.prompt_tokens for s in specs] == [300, 275, 75] and arrivals == [0.0, 0.25, 1.0]
    assert "window 0s+3s" in described and "lengths x0.25" in described
    assert loadgen.workload_from_args(args, 10, 0) == specs
    bad = parser.parse_args(["--dataset", "mooncake", "--dataset-path", str(path)])
    with pytest.raises(ValueError, match="needs --tokenizer"):
        loadgen.trace_from_args(bad, 10, 0)
    bad = parser.parse_args(["--dataset", "azure", "--dataset-path", str(path), "--token-ids", "9", "--trace-window",
                             "x"])
    with pytest.raises(ValueError, match="START:DURATION"):
        loadgen.trace_from_args(bad, 10, 0)
    assert trace_replay.FORMATS == ("mooncake", "azure")
