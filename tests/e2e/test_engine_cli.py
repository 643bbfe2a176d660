"""`pdserve generate` and `pdserve bench engine` as a user runs them (real subprocesses)."""

import subprocess

from harness.procs import VENV_BIN

PDSERVE = str(VENV_BIN / "pdserve")
ENV = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}


def test_generate_streams_a_completion():
    out = subprocess.run(
        [PDSERVE, "generate", "Hello", "--max-tokens", "12", "--ignore-eos", "--threads", "1"],
        capture_output=True, text=True, timeout=120, env=ENV,
    )
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.strip()) >= 6  # the built-in model writes printable ASCII
    assert "[12 tokens in" in out.stderr and "finish: length" in out.stderr


def test_generate_bad_input_is_a_clear_error():
    out = subprocess.run([PDSERVE, "generate", "x", "--temperature", "-1"], capture_output=True, text=True, timeout=120,
                         env=ENV)
    assert out.returncode == 2 and "temperature must be >= 0, got -1" in out.stderr
    out = subprocess.run([PDSERVE, "generate", "x", "--model", "/no/such/dir"], capture_output=True, text=True,
                         timeout=120, env=ENV)
    assert out.returncode == 2 and "neither a built-in model" in out.stderr


def test_bench_engine_smoke():
    out = subprocess.run(
        [PDSERVE, "bench", "engine", "--models", "tiny", "--batches", "2", "--prompt-len", "8", "--gen-len", "4",
         "--reps", "1"],
        capture_output=True, text=True, timeout=300, env=ENV,
    )
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("| tiny | 2 |"))
    assert row.rstrip().endswith("| yes |")  # same greedy tokens as transformers
