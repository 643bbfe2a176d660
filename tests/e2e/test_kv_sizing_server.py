"""The KV pool's size at a real server's start (pdserve/kv_sizing.py): a decode started with
--kv-cache-memory has the blocks that budget holds (its /health) and says why in its one start-up
line; one without a size flag keeps the CPU default and says so; --device cuda where torch sees no
GPU stops the server at start with a message naming CUDA and the flag, not a traceback."""

import os
import subprocess

import pytest

from harness.pd_cluster import COMMON, Server, get_json, wait_ready
from harness.procs import VENV_BIN
from pdserve.net import free_port

pytestmark = pytest.mark.slow
BLOCK_BYTES = 65536  # the tiny model, float32: 4 layers x K,V x 64 tokens x 2 KV heads x 16 dims x 4 bytes


def start_decode(procs, name: str, *flags: str) -> Server:
    grpc_port, http_port, kv_port = free_port(), free_port(), free_port()
    proc = procs.pdserve("decode", "--port", str(grpc_port), "--http-port", str(http_port), "--kv-port", str(kv_port),
                         *COMMON, *flags, name=name)
    return Server(proc, http_port, grpc_port, kv_port, name)


def test_a_decode_sizes_its_pool_from_bytes_and_says_why(procs, tmp_path):
    by_bytes = start_decode(procs, "bytes", "--kv-cache-memory", "3MiB")
    by_default = start_decode(procs, "default")
    wait_ready(by_bytes)
    wait_ready(by_default)
    assert get_json(by_bytes.url + "/health")[1]["kv_blocks_total"] == 3 * (1 << 20) // BLOCK_BYTES == 48
    assert get_json(by_default.url + "/health")[1]["kv_blocks_total"] == 256
    log = (tmp_path / "logs" / "bytes.log").read_text()
    assert ("KV cache: 48 blocks = 3072 tokens (64 per block), 3.00 MiB (3145728 bytes), float32 on cpu; "
            "sized by --kv-cache-memory 3.00 MiB (3145728 bytes) / 65536 bytes per block") in log, log
    log = (tmp_path / "logs" / "default.log").read_text()
    assert "KV cache: 256 blocks = 16384 tokens" in log and "sized by the CPU default of 256 blocks" in log, log
    assert "--kv-cache-memory BYTES sizes the pool from bytes" in log


def test_cuda_asked_for_without_a_gpu_stops_the_server_at_start(tmp_path):
    # CUDA_VISIBLE_DEVICES="": no GPU is visible to the server, also on a machine that has one (never skipped)
    proc = subprocess.run([str(VENV_BIN / "pdserve"), "decode", "--device", "cuda", "--port", str(free_port()),
                           "--http-port", str(free_port()), "--kv-port", str(free_port()), *COMMON],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode != 0
    assert "CUDA" in proc.stderr and "--device cuda" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
