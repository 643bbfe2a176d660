"""tools/gpu/check.py, the prepared GPU check, end to end on this CPU (``--device cpu --smoke``).

One smoke run in a subprocess (300 s hang guard; about 55 s here): every section is in
check.json with its figures (times, rates and fractions > 0), parity holds for every family
in float32 (tokens equal, logits within 1e-4), the transformers twin computes the same logits,
TP 2 on gloo gives TP 1's tokens, and the summary table is printed. The P/D section is skipped in a
CPU smoke run (two servers: about 45 s here); its parsing and its kill at the budget are checked on a stand-in script.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools" / "gpu"
CHECK = TOOLS / "check.py"
FAMILIES = {"llama", "qwen2", "mistral", "qwen3", "gemma2", "gemma3", "qwen3_moe"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    proc = subprocess.run([sys.executable, str(CHECK), "--device", "cpu", "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert (out / "check.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads((out / "check.json").read_text())


def test_the_run_succeeds_and_prints_one_summary_table(smoke):
    proc, doc = smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("GPU check summary") == 1
    table = proc.stdout[proc.stdout.index("GPU check summary"):]
    for name in ("ceilings", "parity", "decode", "prefill", "transformers", "fp8", "pd", "tp"):
        assert f"\n{name} " in table, name
    assert len(doc["summary"]) >= 20


def test_every_section_is_recorded(smoke):
    _, doc = smoke
    statuses = {name: s["status"] for name, s in doc["sections"].items()}
    assert statuses == {"ceilings": "ok", "parity": "ok", "decode": "ok", "prefill": "ok", "transformers": "ok",
                        "fp8": "ok", "pd": "skipped", "tp": "ok"}
    meta = doc["meta"]
    assert meta["device"] == "cpu" and meta["torch"] and meta["date"] and meta["plan"]["smoke"]
    assert meta["gpu_name"] is None and "triton" in meta


def test_tensor_parallel_two_ranks_equal_one(smoke):
    """The tp section on the CPU: TP 2 (gloo, one worker process) greedy tokens equal TP 1's, every time > 0."""
    res = smoke[1]["sections"]["tp"]["results"]
    assert res["sizes"] == [1, 2] and not res.get("unmeasured")
    one, two = res["runs"]
    assert two["tokens_equal"] and two["tokens"] == one["tokens"] and len(one["tokens"][0]) == 6
    for row in (one, two):
        assert row["prefill_ms"] > 0 and row["decode_b1_ms"] > 0 and row["decode_bn_ms"] > 0
    assert two["prefill_speedup"] > 0 and two["decode_b1_speedup"] > 0


def test_ceilings_are_positive(smoke):
    res = smoke[1]["sections"]["ceilings"]["results"]
    assert res["copy"]["gb_per_s"] > 0 and res["copy"]["ms"] > 0
    assert res["gemm"]["tflop_per_s"] > 0 and res["gemm"]["n"] == 256


def test_parity_of_every_family_in_float32(smoke):
    res = smoke[1]["sections"]["parity"]["results"]
    assert res["dtype"] == "float32"
    assert {r["family"] for r in res["rows"]} == FAMILIES
    for r in res["rows"]:
        assert r["tokens_equal"] and r["first_difference"] is None, r
        assert r["within_tol"] and r["max_diff"] <= r["tol"] == 1e-4, r


def test_decode_cells_have_figures(smoke):
    res = smoke[1]["sections"]["decode"]["results"]
    assert res["weight_bytes"] > 0 and res["copy_gb_per_s"] > 0
    assert {(c["batch"], c["context"]) for c in res["cells"]} == {(1, 64), (2, 64), (1, 128), (2, 128)}
    for c in res["cells"]:
        assert c["fits"] and c["bytes_read"] == res["weight_bytes"] + c["kv_bytes"] > 0
        assert c["eager"]["ms"] > 0 and c["eager"]["gb_per_s"] > 0 and c["eager"]["fraction_of_copy"] > 0
        assert len(c["eager"]["samples_ms"]) == 3
        assert c["graphs"] == {"status": "n/a on cpu"}


def test_prefill_cells_have_figures(smoke):
    res = smoke[1]["sections"]["prefill"]["results"]
    assert [c["prompts"] for c in res["cells"]] == [1, 2]
    for c in res["cells"]:
        assert c["s"] > 0 and c["flop"] > 0 and c["tflop_per_s"] > 0 and c["fraction_of_gemm"] > 0


def test_transformers_runs_on_the_same_tensors(smoke):
    res = smoke[1]["sections"]["transformers"]["results"]
    assert res["same_weights_max_logit_diff"] < 1e-4
    kinds = [(r["kind"], r.get("batch", r.get("prompts"))) for r in res["rows"]]
    assert kinds == [("decode", 1), ("decode", 2), ("prefill", 1), ("prefill", 2)]
    for r in res["rows"]:
        assert r["speedup"] > 0
        unit = "ms" if r["kind"] == "decode" else "s"
        assert r[f"ours_{unit}"] > 0 and r[f"theirs_{unit}"] > 0
        assert len(r[f"ours_samples_{unit}"]) == len(r[f"theirs_samples_{unit}"]) == 2


def test_fp8_cells_have_figures(smoke):
    """FP8 weights against the dtype's on the same random tensors: A B rounds of decode and prefill, tokens."""
    res = smoke[1]["sections"]["fp8"]["results"]
    assert "C++ kernel" in res["path"]  # the CPU's path (a GPU with FP8 tensor cores: torch._scaled_mm)
    [decode] = res["decode"]
    assert (decode["batch"], decode["context"]) == (1, 64) and len(decode["rounds"]) == 2
    assert all(r["fp8_ms"] > 0 and r["dtype_ms"] > 0 for r in decode["rounds"]) and decode["worst_ratio"] > 0
    [prefill] = res["prefill"]
    assert prefill["prompts"] == 2 and prefill["worst_speedup"] > 0
    acc = res["accuracy"]
    assert acc["prompts"] == 2 and 0 <= acc["first_token_agreement"] <= 1 and acc["max_logit_diff_over_std"] >= 0
    rows = [r for r in smoke[1]["summary"] if r["section"] == "fp8"]
    assert any(r["cell"] == "decode B1 ctx 64" and r["verdict"] == "n/a (smoke)" for r in rows)


def _fake_pd_check(tmp_path: Path, verdict: str, then_sleep: float) -> Path:
    script = tmp_path / "fake_pd_check.py"
    script.write_text(textwrap.dedent(f"""
        import time
        print("request 0: 57 prompt tokens, 0.25 s, same text as the engine alone", flush=True)
        print("request 1: 91 prompt tokens, 0.35 s, same text as the engine alone", flush=True)
        print({verdict!r}, flush=True)
        time.sleep({then_sleep})
    """))
    return script


def test_pd_pair_reads_the_verdict_and_kills_at_its_budget(tmp_path):
    sys.path.insert(0, str(TOOLS))
    try:
        import pdpair
    finally:
        sys.path.remove(str(TOOLS))
    good = "cuda bfloat16 tcp: 2 of 2 P/D texts equal the engine alone; held after: nothing"
    done = pdpair.run_check(["--x"], 60, script=_fake_pd_check(tmp_path, good, 0))
    assert done["rc"] == 0 and done["ok"] and done["verdict"] == good
    assert [(r["request"], r["prompt_tokens"], r["s"]) for r in done["requests"]] == [(0, 57, 0.25), (1, 91, 0.35)]
    # killed while its servers stop, after the verdict line: the check itself was done
    slow = pdpair.run_check([], 3, script=_fake_pd_check(tmp_path, good, 60))
    assert slow["rc"] is None and slow["ok"] and "killed after 3 s" in slow["error"] and slow["seconds"] < 30
    bad = "cuda bfloat16 tcp: 1 of 2 P/D texts equal the engine alone; held after: nothing"
    assert not pdpair.run_check([], 60, script=_fake_pd_check(tmp_path, bad, 0))["ok"]


def test_the_long_prompt_cell_reads_ttft_and_kv_figures_and_summarises_them(tmp_path):
    """pd_device_check.py --prompt-lens lines (TTFT against the prefill alone, KV per request) parsed and shown."""
    sys.path.insert(0, str(TOOLS))
    try:
        import pdpair
        import summary
    finally:
        sys.path.remove(str(TOOLS))
    line = ("request 0: 2048 prompt tokens, 0.80 s, ttft 51.5 ms vs prefill alone 47.0 ms (1.10x), kv span 40.2 ms, "
            "kv layer sends 6.0 ms, kv 32.0 MiB, same text as the engine alone")
    script = tmp_path / "fake_long.py"
    script.write_text(f"print({line!r})\nprint('cuda bfloat16 tcp: 1 of 1 P/D texts equal the engine alone; "
                      "held after: nothing')\n")
    got = pdpair.run_check([], 60, script=script)
    assert got["ok"] and got["requests"][0] == {
        "request": 0, "prompt_tokens": 2048, "s": 0.8, "verdict": line.split("0.80 s, ", 1)[1], "ttft_ms": 51.5,
        "alone_ttft_ms": 47.0, "ttft_ratio": 1.1, "kv_span_ms": 40.2, "kv_layer_sends_ms": 6.0, "kv_mib": 32.0}
    got["transfer"] = "tcp long"
    rows = summary.pd_rows({"long": [got]}, None)
    cell = [r for r in rows if r[1] == "tcp long 2048 tokens"]
    assert cell and "1.10x alone" in cell[0][2] and "5.21 GiB/s" in cell[0][2] and cell[0][4] == "ok"
