"""The KV pool's size from the servers' flags (pdserve/kv_sizing.py): precedence, bytes -> blocks
for the built-in model, vLLM's GPU rule with injected numbers (and a fake torch.cuda around a real
profiling forward), clear errors, device and dtype defaults, the vLLM backend's mapping, --help."""

import argparse

import pytest
import torch

from pdserve import kv_sizing
from pdserve.engine.loader import tiny_config
from pdserve.kv_sizing import GpuMemory, KVFlags, size_kv_pool
from pdserve.server_setup import add_engine_arguments, load_engine, resolve_device

GIB, MIB = 1 << 30, 1 << 20
# the built-in model: 4 layers x K,V x 64 tokens x 2 KV heads x 16 dims x 4 bytes (float32)
TINY_BLOCK_BYTES = 4 * 2 * 64 * 2 * 16 * 4


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(list(argv))


def must_not_measure() -> GpuMemory:
    raise AssertionError("the GPU was measured although a flag above --gpu-memory-utilization decides")


def size(flags: KVFlags, measure=must_not_measure, bytes_per_block=TINY_BLOCK_BYTES):
    return size_kv_pool(flags, dtype="float32", block_size=64, bytes_per_block=bytes_per_block, measure_gpu=measure)


def test_a_block_of_the_tiny_model_costs_what_the_engine_allocates():
    cfg = tiny_config()
    per_block = kv_sizing.pool_bytes_per_block("float32", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64)
    assert per_block == TINY_BLOCK_BYTES == 65536
    assert kv_sizing.pool_bytes_per_block("bfloat16", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64) == 32768


@pytest.mark.parametrize("flags, source, blocks", [
    (KVFlags("cpu", num_blocks=7, kv_cache_memory=4 * MIB), kv_sizing.NUM_BLOCKS, 7),
    (KVFlags("cuda", num_blocks=7, kv_cache_memory=4 * MIB, gpu_memory_utilization=0.5), kv_sizing.NUM_BLOCKS, 7),
    (KVFlags("cuda:1", kv_cache_memory=4 * MIB, gpu_memory_utilization=0.5), kv_sizing.KV_CACHE_MEMORY, 64),
    (KVFlags("cpu", kv_cache_memory=4 * MIB + TINY_BLOCK_BYTES - 1), kv_sizing.KV_CACHE_MEMORY, 64),  # floor
    (KVFlags("cpu"), kv_sizing.CPU_DEFAULT, 256),
    (KVFlags("cpu", num_blocks=9, gpu_memory_utilization=0.5), kv_sizing.NUM_BLOCKS, 9),
])
def test_precedence_num_blocks_then_bytes_then_gpu_then_the_cpu_default(flags, source, blocks):
    assert flags.source() == source
    got = size(flags)
    assert got.num_blocks == blocks and got.tokens == blocks * 64 and got.nbytes == blocks * TINY_BLOCK_BYTES


def test_the_cpu_default_says_so_and_names_the_byte_flag():
    line = size(KVFlags("cpu")).describe()
    assert "256 blocks = 16384 tokens" in line and "float32 on cpu" in line
    assert "the CPU default of 256 blocks" in line and "--kv-cache-memory" in line


def test_gpu_memory_utilization_leaves_kv_what_weights_and_activations_do_not_use():
    memory = GpuMemory(total=80 * GIB, in_use=20 * GIB, activation_peak=4 * GIB, profile_tokens=8192)
    assert kv_sizing.gpu_kv_bytes(memory, 0.9) == int(0.9 * 80 * GIB) - 24 * GIB
    calls = []
    got = size(KVFlags("cuda", gpu_memory_utilization=0.5), measure=lambda: calls.append(1) or memory,
               bytes_per_block=MIB)
    assert calls == [1]
    assert got.num_blocks == 16 * 1024  # 40 GiB - 20 GiB - 4 GiB = 16 GiB of 1 MiB blocks
    line = got.describe()
    for part in ("--gpu-memory-utilization 0.5", "80.00 GiB total", "20.00 GiB in use after loading the weights",
                 "4.00 GiB activation peak of a 8192-token forward", "16.00 GiB", "on cuda"):
        assert part in line, line
    default = size(KVFlags("cuda"), measure=lambda: memory, bytes_per_block=MIB)
    assert default.num_blocks == (int(0.9 * 80 * GIB) - 24 * GIB) // MIB
    assert "--gpu-memory-utilization 0.9 (the default)" in default.describe()


def test_nothing_left_for_kv_is_a_clear_error_with_the_numbers():
    memory = GpuMemory(total=80 * GIB, in_use=70 * GIB, activation_peak=3 * GIB, profile_tokens=8192)
    with pytest.raises(ValueError) as err:
        size(KVFlags("cuda:0"), measure=lambda: memory)
    msg = str(err.value)
    for part in ("--gpu-memory-utilization 0.9 leaves no memory for the KV cache on cuda:0", "80.00 GiB total",
                 "70.00 GiB in use", "3.00 GiB activation peak", "--kv-cache-memory", "--num-blocks"):
        assert part in msg, msg
    with pytest.raises(ValueError, match="--kv-cache-memory 1000 .* holds no KV block.*65536 bytes"):
        size(KVFlags("cpu", kv_cache_memory=1000))


def test_bad_flag_values_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--gpu-memory-utilization sizes the KV cache from a CUDA device"):
        KVFlags("cpu", gpu_memory_utilization=0.8).source()
    with pytest.raises(ValueError, match="--num-blocks must be > 0"):
        KVFlags("cpu", num_blocks=0)
    with pytest.raises(ValueError, match="--kv-cache-memory must be > 0"):
        KVFlags("cpu", kv_cache_memory=0)
    for bad in ("0", "1.5", "-0.1", "lots"):
        with pytest.raises(argparse.ArgumentTypeError, match="0 < F <= 1"):
            kv_sizing.utilization_flag(bad)
    assert kv_sizing.utilization_flag("1") == 1.0


def test_the_flags_parse_with_units_and_defaults():
    args = parse()
    assert (args.num_blocks, args.kv_cache_memory, args.gpu_memory_utilization, args.dtype, args.device) == (
        None, None, None, None, "cpu")
    args = parse("--kv-cache-memory", "4GiB", "--gpu-memory-utilization", "0.85", "--num-blocks", "12",
                 "--device", "cuda:1")
    assert (args.kv_cache_memory, args.gpu_memory_utilization, args.num_blocks, args.device) == (4 * GIB, 0.85, 12,
                                                                                                 "cuda:1")


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cuda:", "CPU0", "mps"])
def test_a_bad_device_is_refused_at_parse(device, capsys):
    with pytest.raises(SystemExit):
        parse("--device", device)
    assert "--device" in capsys.readouterr().err


def test_dtype_defaults_follow_the_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for argv, dtype in ((["--device", "cuda"], "bfloat16"), (["--device", "cuda:1"], "bfloat16"), ([], "float32"),
                        (["--device", "cuda", "--dtype", "float16"], "float16"), (["--dtype", "bfloat16"], "bfloat16")):
        args = parse(*argv)
        resolve_device(args)
        assert args.dtype == dtype, argv
    assert (kv_sizing.default_dtype("cuda:3"), kv_sizing.default_dtype("cpu")) == ("bfloat16", "float32")


def test_kv_checksums_default_on_except_nixl_on_cuda_and_the_log_says_so(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    caplog.set_level("INFO", logger="pdserve.server")
    for argv, on in (([], True), (["--transfer", "nixl"], True), (["--device", "cuda"], True),
                     (["--device", "cuda", "--transfer", "nixl"], False), (["--no-kv-checksum"], False),
                     (["--device", "cuda", "--transfer", "nixl", "--kv-checksum"], True)):
        caplog.clear()
        args = parse(*argv)
        resolve_device(args)
        assert args.kv_checksum is on, argv
        said = [r.getMessage() for r in caplog.records if "KV checksums" in r.getMessage()]
        explicit = any(a.endswith("kv-checksum") for a in argv)
        assert len(said) == (0 if explicit else 1), (argv, said)
        assert explicit or ("on: crc32c" in said[0] if on else "copy every slice to the host" in said[0]), said


def test_cuda_unavailable_stops_the_server_naming_cuda_and_the_flag(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = parse("--device", "cuda")
    with pytest.raises(SystemExit) as err:
        resolve_device(args)
    msg = str(err.value)
    assert "CUDA" in msg and "--device cuda" in msg and "--device cpu" in msg, msg
    with pytest.raises(ValueError, match=r"--device cuda:2: CUDA shows 1 GPU"):
        kv_sizing.check_cuda("cuda:2", True, 1)
    kv_sizing.check_cuda("cpu", False, 0)  # the CPU needs no CUDA


def test_a_server_engine_gets_the_blocks_its_byte_budget_holds(caplog):
    """The real start-up path (load_engine) with --kv-cache-memory: the pool tensor is exactly the budget."""
    args = parse("--model", "tiny", "--kv-cache-memory", "4MiB")
    with caplog.at_level("INFO", logger="pdserve.server"):
        _, engine, _ = load_engine(args)
    assert engine.num_blocks == 64 and engine.kv_cache.tensor.nbytes == 4 * MIB
    assert any("KV cache: 64 blocks = 4096 tokens" in r.message and "sized by --kv-cache-memory 4.00 MiB" in r.message
               for r in caplog.records), caplog.text
    args = parse("--model", "tiny", "--kv-cache-memory", "4MiB", "--dtype", "bfloat16")
    assert load_engine(args)[1].num_blocks == 128  # half the bytes per block
    with pytest.raises(SystemExit, match="gpu-memory-utilization sizes the KV cache from a CUDA device"):
        load_engine(parse("--model", "tiny", "--gpu-memory-utilization", "0.5"))


@pytest.mark.parametrize("batched, max_len, seqs, lengths", [
    (8192, 2048, 32, [2047] * 4 + [4]),  # the token budget, in prompts of at most the context - 1
    (8192, 2048, 2, [2047, 2047]),  # at most max_num_seqs prompts
    (100, 32768, 8, [32767]),  # one whole-context prompt is admitted alone, whatever the budget
])
def test_the_profiling_forward_is_the_engines_largest_step(batched, max_len, seqs, lengths):
    assert kv_sizing.profile_prompt_lengths(batched, max_len, seqs) == lengths


class FakeCuda:
    """torch.cuda's memory calls, recorded in order with the model's forward passes."""

    def __init__(self, events: list):
        self.events = events

    def synchronize(self, device=None):
        self.events.append("synchronize")

    def empty_cache(self):
        self.events.append("empty_cache")

    def mem_get_info(self, device=None):
        self.events.append("mem_get_info")
        free = 30 * GIB if self.events.count("mem_get_info") == 1 else 28 * GIB  # the forward's workspaces stay
        return free, 80 * GIB

    def reset_peak_memory_stats(self, device=None):
        self.events.append("reset_peak")

    def memory_allocated(self, device=None):
        self.events.append("allocated")
        return 21 * GIB

    def max_memory_allocated(self, device=None):
        self.events.append("max_allocated")
        return 23 * GIB


def test_measure_gpu_memory_reads_the_peak_around_one_real_profiling_forward():
    from pdserve.engine import EngineConfig, load_model

    loaded = load_model("tiny")
    events = []
    hook = loaded.model.register_forward_hook(lambda *_: events.append("forward"))
    try:
        memory = kv_sizing.measure_gpu_memory(
            loaded, EngineConfig(block_size=16, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=300),
            cuda=FakeCuda(events))
    finally:
        hook.remove()
    assert memory == GpuMemory(total=80 * GIB, in_use=52 * GIB, activation_peak=2 * GIB, profile_tokens=300)
    assert events.index("reset_peak") < events.index("allocated") < events.index("forward")
    assert events.index("forward") < events.index("max_allocated") < len(events) - 1 - events[::-1].index("empty_cache")
    assert events[-1] == "mem_get_info" and events.count("forward") == 1


def vllm_args(*argv: str):
    return parse("--engine", "vllm", *argv)


def test_the_vllm_backend_maps_the_size_flags():
    from pdserve.vllm_backend.server import vllm_kv_cache_args

    kv, why = vllm_kv_cache_args(vllm_args("--num-blocks", "48"), 1000)
    assert kv == {"num_gpu_blocks_override": 49, "kv_cache_memory_bytes": 49_000} and "--num-blocks 48" in why
    kv, why = vllm_kv_cache_args(vllm_args("--num-blocks", "48", "--kv-cache-memory", "1GiB"), 1000)
    assert kv["num_gpu_blocks_override"] == 49
    kv, why = vllm_kv_cache_args(vllm_args("--kv-cache-memory", "1GiB"), 1000)
    assert kv == {"kv_cache_memory_bytes": GIB} and "--kv-cache-memory" in why
    kv, why = vllm_kv_cache_args(vllm_args(), 1000)
    assert kv["num_gpu_blocks_override"] == 257 and "CPU default" in why


@pytest.mark.parametrize("argv, message", [
    (["--device", "cuda"], "--device cuda does not map"),
    (["--gpu-memory-utilization", "0.8"], "--gpu-memory-utilization does not map"),
    (["--kv-cache-memory", "1GiB", "--gpu-memory-utilization", "0.8"], "--gpu-memory-utilization does not map"),
    (["--kv-host-tier-bytes", "1MiB"], "--kv-host-tier-bytes do(es) not map"),
])
def test_the_vllm_backend_refuses_flags_that_do_not_map(argv, message):
    from pdserve.vllm_backend.server import vllm_kv_cache_args

    with pytest.raises(SystemExit) as err:
        vllm_kv_cache_args(vllm_args(*argv), 1000)
    assert message in str(err.value)


def one_line_help(prog):
    return argparse.HelpFormatter(prog, max_help_position=80, width=10_000)


def test_help_explains_each_flag():
    from pdserve.decode_server.cli import add_arguments

    parser = argparse.ArgumentParser(formatter_class=one_line_help)
    add_arguments(parser)
    lines = {line.split()[0]: line for line in parser.format_help().splitlines() if line.strip().startswith("--")}
    assert "over --kv-cache-memory and --gpu-memory-utilization" in lines["--num-blocks"]
    assert "256 blocks" in lines["--num-blocks"]
    assert "in bytes, on the CPU or the GPU (e.g. 4GiB)" in lines["--kv-cache-memory"]
    assert "CUDA only, 0 < F <= 1 (default 0.9" in lines["--gpu-memory-utilization"]
    assert "activation peak" in lines["--gpu-memory-utilization"]
    assert "bfloat16 on --device cuda, float32 on cpu" in lines["--dtype"]
    assert "cpu, cuda or cuda:N" in lines["--device"]


def test_a_kv_pool_with_vllms_engine_is_refused_naming_both_flags():
    from pdserve.decode_server.cli import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit) as err:
        run(parser.parse_args(["--model", "tiny", "--engine", "vllm", "--kv-pool", "127.0.0.1:1"]))
    assert "--kv-pool needs the built-in engine" in str(err.value) and "--engine vllm" in str(err.value)


def test_a_tensor_parallel_server_that_moves_kv_counts_rank_0s_transfer_pool():
    """--tensor-parallel-size 2 on the built-in model (2 KV heads): a rank's pool holds 1 head per block; a server
    that moves KV (P/D) holds both again in rank 0's transfer pool (engine/tp/transfer.py), so rank 0, the
    tightest rank, pays 3 heads per block and its budget gives a third as many blocks as 1 head would."""
    args = parse("--model", "tiny", "--kv-cache-memory", "4MiB", "--tensor-parallel-size", "2")
    _, engine, _ = load_engine(args, kv_transfer=True)
    try:
        assert engine.num_blocks == (4 * MIB) // (3 * 32 * 1024)
        assert engine.kv_cache.tensor.nbytes + engine.transfer_cache.tensor.nbytes <= 4 * MIB
    finally:
        engine.close()
    _, engine, _ = load_engine(args)  # no KV moves: no transfer pool, one head per block
    try:
        assert engine.num_blocks == 128 and engine.transfer is None
    finally:
        engine.close()
