"""The peer experiment's pure parts: the checkpoint's tokenizer, the proxy's prefill request, the
aggregation into medians, ratios and targets. (The experiment itself against a real vLLM is in
tests/e2e/test_peer_experiment.py.)"""

import pytest

from pdserve.bench.experiments.peer_model import PEER_MODELS, kv_bytes_per_token, peer_config, write_tokenizer
from pdserve.bench.experiments.peer_proxy import prefill_body
from pdserve.bench.experiments.peer_report import FIGURES, aggregate, cell_name, format_table


def test_every_id_of_the_tokenizer_decodes_to_its_own_word(tmp_path):
    from pdserve.engine.tokenizer import HFTokenizer

    write_tokenizer(tmp_path, 64, 256)
    tok = HFTokenizer(tmp_path, config_eos_ids=[63])
    assert tok.vocab_size == 64 and tok.eos_token_ids == [63]
    assert tok.encode("t5 t17 t61") == [5, 17, 61]
    d = tok.detokenizer()
    assert [d.add([i]) for i in range(62)] == ["t0"] + [f" t{i}" for i in range(1, 62)]  # never an empty delta
    for size in PEER_MODELS:
        cfg = peer_config(size, 1024)
        assert cfg.head_dim == 64  # vLLM-CPU's attention kernels have no smaller head size
        assert kv_bytes_per_token(size) == cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4


def test_prefill_request_asks_for_one_token_and_a_remote_decode():
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 64, "min_tokens": 64, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    pre = prefill_body(body)
    assert pre["max_tokens"] == 1 and pre["stream"] is False and "min_tokens" not in pre
    assert "stream_options" not in pre and pre["ignore_eos"] is True and pre["prompt"] == [1, 2]
    assert pre["kv_transfer_params"]["do_remote_decode"] is True
    assert pre["kv_transfer_params"]["do_remote_prefill"] is False
    assert body["max_tokens"] == 64 and "kv_transfer_params" not in body  # the client's request is not changed


def _figures(scale: float, failed: int = 0) -> dict:
    f = {name: scale for name in FIGURES}
    f.update(output_tok_s=10 / scale, failed=failed, requests=10)
    return f


def test_aggregate_takes_medians_over_repeats_and_checks_the_targets():
    cell = cell_name(512, 64, 1.0)
    assert cell == "p512-o64-r1"
    runs = [
        {"system": "pdserve", "repeat": 0, "cells": {cell: _figures(0.5)}},
        {"system": "vllm", "repeat": 0, "cells": {cell: _figures(1.0)}},
        {"system": "pdserve", "repeat": 1, "cells": {cell: _figures(0.7, failed=1)}},
        {"system": "vllm", "repeat": 1, "cells": {cell: _figures(1.0)}},
        {"system": "pdserve", "repeat": 2, "cells": {cell: _figures(9.0)}},  # an outlier the median ignores
        {"system": "vllm", "repeat": 2, "cells": {cell: _figures(1.0)}},
    ]
    e = aggregate(runs)[cell]
    assert e["medians"]["pdserve"]["ttft_mean"] == 0.7 and e["medians"]["pdserve"]["repeats"] == 3
    assert e["medians"]["pdserve"]["failed"] == 1 and e["medians"]["pdserve"]["requests"] == 30
    assert e["ratios"]["ttft_mean"] == pytest.approx(0.7)
    assert e["ratios"]["output_tok_s"] == pytest.approx(10 / 0.7 / 10)
    assert e["met"] == {"ttft_mean": True, "tpot_mean": True, "itl_p99": True, "output_tok_s": True, "failed": False}
    assert e["all_met"] is False
    text = format_table(aggregate(runs))
    assert "p512-o64-r1" in text and "MISS" in text and "pdserve" in text and "vllm" in text


def test_aggregate_without_the_other_system_gives_medians_and_no_ratios():
    cell = cell_name(64, 8, 2.5)
    e = aggregate([{"system": "pdserve", "repeat": 0, "cells": {cell: _figures(1.0)}}])[cell]
    assert set(e["medians"]) == {"pdserve"} and "ratios" not in e
    assert cell in format_table({cell: e})


def test_run_figures_keep_the_first_message_of_each_error_kind():
    from pdserve.bench.loadgen_report import RequestResult, summarize
    from pdserve.bench.experiments.peer_report import run_figures

    ok = RequestResult(0, 8, 3, ok=True, ttft=0.1, e2e=0.3, gaps=[0.1, 0.1], chunks=3)
    bad = [RequestResult(i, 8, 3, error=f"HTTP 503: busy {i}") for i in (1, 2)]
    f = run_figures(summarize([ok, *bad], 1.0), [ok, *bad])
    assert f["failed"] == 2 and f["requests"] == 3 and f["errors"] == {"HTTP 503": 2}
    assert f["error_examples"] == {"HTTP 503": "HTTP 503: busy 1"}
    assert f["tpot_mean"] == pytest.approx(0.1) and len(f["ttft_quantiles"]) == 100


def test_pdserve_servers_get_the_same_kv_budget_on_either_engine():
    import argparse

    from pdserve.bench.experiments import peer

    parser = argparse.ArgumentParser()
    peer.add_arguments(parser)
    flags, blocks = peer.pdserve_engine_flags(parser.parse_args(["--kv-tokens", "16384", "--transfer", "nixl"]))
    assert flags == ["--transfer", "nixl", "--dtype", "float32"] and blocks * peer.BLOCK_SIZE == 16384
    flags, blocks = peer.pdserve_engine_flags(parser.parse_args(["--kv-tokens", "1000", "--pdserve-engine", "vllm"]))
    assert flags[flags.index("--engine") + 1] == "vllm" and int(flags[flags.index("--block-size") + 1]) == 32
    assert blocks == 32  # 1000 tokens round up to whole 32-token blocks
    flags, blocks = peer.pdserve_engine_flags(parser.parse_args(["--kv-tokens", "1000", "--pdserve-engine", "vllm",
                                                                 "--pdserve-vllm-block-size", "128"]))
    assert int(flags[flags.index("--block-size") + 1]) == 128 and blocks == 8
    with pytest.raises(SystemExit):
        parser.parse_args(["--pdserve-engine", "sglang"])
    flags, _ = peer.pdserve_engine_flags(parser.parse_args(["--dtype", "bfloat16"]))
    assert flags[flags.index("--dtype") + 1] == "bfloat16"


def test_every_cell_sends_its_own_prompts():
    """Cells that differ only in rate must not repeat prompts (the later one would hit the prefix cache)."""
    import random

    from pdserve.bench.experiments.peer import cell_seed
    from pdserve.bench.loadgen_workload import random_requests

    pool = list(range(1000))
    cells = [(512, 64, 0.53), (512, 64, 0.95), (512, 256, 0.53), (2048, 64, 0.53)]
    assert len({cell_seed(0, *c) for c in cells}) == len(cells)
    first = [random_requests(3, p, o, random.Random(cell_seed(0, p, o, r)), pool) for p, o, r in cells[:2]]
    assert first[0][0].prompt_ids != first[1][0].prompt_ids
    assert cell_seed(0, *cells[0]) == cell_seed(0, *cells[0]) != cell_seed(1, *cells[0])  # same for both systems


def test_the_baseline_tree_is_compared_per_repeat_with_its_target(tmp_path):
    """--baseline-tree: pdserve / baseline per figure, each repeat's ratio, the verdict on TTFT p99 <= 0.7."""
    import argparse

    from pdserve.bench.experiments.peer import baseline_pdserve, systems
    from pdserve.bench.experiments.peer_baseline import compare, format_compare

    cell = "trace"
    runs = []
    for repeat, (mine, before) in enumerate(((0.5, 1.0), (0.6, 1.0), (0.9, 1.0))):
        runs.append({"system": "pdserve", "repeat": repeat, "cells": {cell: _figures(mine)}})
        runs.append({"system": "baseline", "repeat": repeat, "cells": {cell: _figures(before)}})
    table = aggregate(runs)
    assert set(table[cell]["medians"]) == {"pdserve", "baseline"} and "ratios" not in table[cell]  # no vLLM
    got = compare(runs, table)[cell]
    assert got["ttft_p99"]["ratio"] == pytest.approx(0.6)
    assert got["ttft_p99"]["pairs"] == pytest.approx([0.5, 0.6, 0.9])
    assert got["ttft_p99"]["verdict"] == "met (pairs on both sides of the target)"  # one repeat at 0.9 > 0.7
    assert "verdict" not in got["tpot_mean"] and got["output_tok_s"]["better"] == "higher"
    assert "ttft_p99" in format_compare({cell: got})
    grid_runs = [{**r, "cells": {"p512-o256-r0.5": r["cells"][cell]}} for r in runs]  # a grid cell: no target
    got_grid = compare(grid_runs, aggregate(grid_runs))["p512-o256-r0.5"]
    assert "verdict" not in got_grid["ttft_p99"] and "target" not in format_compare({"g": got_grid})
    args = argparse.Namespace(baseline_tree=tmp_path, no_vllm=True)
    assert systems(args) == ["pdserve", "baseline"]
    assert systems(argparse.Namespace(baseline_tree=None, no_vllm=False)) == ["pdserve", "vllm"]
    with pytest.raises(ValueError, match="make -C"):
        baseline_pdserve(tmp_path)
