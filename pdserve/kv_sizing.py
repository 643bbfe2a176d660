"""How many KV blocks a server's pool gets, and why: its device, dtype and size flags -> ``KVPoolSize``.

The first of these that applies decides (``KVFlags.source``):

1. ``--num-blocks N``: exactly N blocks.
2. ``--kv-cache-memory BYTES``: as many blocks as BYTES holds, on the CPU or the GPU. A block is
   ``--block-size`` tokens of K and V in every layer, in the KV dtype (``pool_bytes_per_block``:
   ``--dtype``, or with ``--kv-cache-dtype fp8`` fp8 rows and their scales, about twice the tokens).
3. On CUDA, ``--gpu-memory-utilization F`` (default 0.9; vLLM's meaning): the server may use F of
   the device's total memory for weights, activations and KV together, so the pool gets
   ``F * total - in use after loading the weights - activation peak`` (``gpu_kv_bytes``), where
   "in use" is total - free (``torch.cuda.mem_get_info``: the CUDA context, the CUDA libraries'
   workspaces and other processes count too; read after the profiling forward, with torch's cache
   emptied) and the activation peak is ``torch.cuda.max_memory_allocated`` over one profiling
   forward of the engine's largest step, less what was allocated before it (``measure_gpu_memory``).
   Nothing left for one block: a ValueError naming the flags and the numbers.
4. On the CPU: ``CPU_DEFAULT_BLOCKS`` (256), the servers' size before byte budgets existed.

Device and dtype: ``--device`` is cpu, cuda or cuda:N (``device_flag``); CUDA asked for where
torch sees none stops the server at start (``check_cuda``). ``--dtype`` defaults to bfloat16 on
CUDA and float32 on the CPU (``default_dtype``).

Everything here but ``measure_gpu_memory`` is pure (no torch), so the GPU arithmetic is tested on
a CPU with the numbers injected; ``measure_gpu_memory`` takes the ``torch.cuda`` module as an
argument, which its test replaces with a fake.
"""

from __future__ import annotations

import argparse
import gc
import re
from dataclasses import dataclass
from typing import Callable

from pdserve.cachestore import CompatInfo

CPU_DEFAULT_BLOCKS = 256
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
GPU_DTYPE, CPU_DTYPE = "bfloat16", "float32"  # --dtype's default on each kind of device
DTYPES = ("float32", "float16", "bfloat16")  # --dtype's choices
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")

# KVFlags.source(): which flag (or default) sizes the pool
NUM_BLOCKS, KV_CACHE_MEMORY, GPU_MEMORY_UTILIZATION, CPU_DEFAULT = (
    "num_blocks", "kv_cache_memory", "gpu_memory_utilization", "cpu_default")


def device_flag(text: str) -> str:
    """--device's type: 'cpu', 'cuda' or 'cuda:N'."""
    if not _DEVICE.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text.strip()


def utilization_flag(text: str) -> float:
    """--gpu-memory-utilization's type: a fraction 0 < F <= 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction 0 < F <= 1, got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction 0 < F <= 1, got {text!r}")
    return value


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def default_dtype(device: str) -> str:
    """--dtype when not given: bfloat16 on a CUDA device, float32 on the CPU."""
    return GPU_DTYPE if is_cuda(device) else CPU_DTYPE


def check_cuda(device: str, available: bool, count: int) -> None:
    """A CUDA ``device`` this process cannot use -> ValueError naming CUDA and --device (a pod
    scheduled on a GPU node without the driver must say so)."""
    if not is_cuda(device):
        return
    if not available:
        raise ValueError(f"--device {device} asks for a CUDA GPU, but torch.cuda.is_available() is False in this "
                         "process (no NVIDIA driver or GPU visible to it, or a CPU-only torch build): run it where a "
                         "GPU and its driver are visible, or pass --device cpu")
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        raise ValueError(f"--device {device}: CUDA shows {count} GPU(s) to this process (cuda:0 to cuda:{count - 1})")


def pool_bytes_per_block(dtype: str, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                         kv_dtype: str = "auto") -> int:
    """What one block id costs the pool: K and V of ``block_size`` tokens in every layer, in the KV
    dtype (``kv_dtype`` "fp8": fp8 rows with their scales, about half of a 16-bit ``dtype``'s)."""
    return CompatInfo(dtype, num_layers, num_kv_heads, head_dim, block_size, kv_dtype).block_nbytes * num_layers


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


@dataclass(frozen=True, slots=True)
class KVFlags:
    """The flags that size the pool, as given (None: not given)."""

    device: str = "cpu"
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float | None = None  # None: DEFAULT_GPU_MEMORY_UTILIZATION on CUDA

    def __post_init__(self) -> None:
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"--num-blocks must be > 0, got {self.num_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"--kv-cache-memory must be > 0 bytes, got {self.kv_cache_memory}")
        util = self.gpu_memory_utilization
        if util is not None and not 0.0 < util <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be within (0, 1], got {util}")

    def source(self) -> str:
        """Which flag or default sizes the pool (the module's precedence). On the CPU,
        --gpu-memory-utilization alone is an error: it would size nothing."""
        if self.num_blocks is not None:
            return NUM_BLOCKS
        if self.kv_cache_memory is not None:
            return KV_CACHE_MEMORY
        if is_cuda(self.device):
            return GPU_MEMORY_UTILIZATION
        if self.gpu_memory_utilization is not None:
            raise ValueError(f"--gpu-memory-utilization sizes the KV cache from a CUDA device's memory, but --device "
                             f"is {self.device}: give --kv-cache-memory BYTES or --num-blocks N instead")
        return CPU_DEFAULT

    @property
    def utilization(self) -> float:
        return DEFAULT_GPU_MEMORY_UTILIZATION if self.gpu_memory_utilization is None else self.gpu_memory_utilization


@dataclass(frozen=True, slots=True)
class GpuMemory:
    """What ``measure_gpu_memory`` read from the device, in bytes."""

    total: int
    in_use: int  # total - free once the weights are loaded (the CUDA context, other processes included)
    activation_peak: int  # the most one profiling forward allocated above what was allocated before it
    profile_tokens: int  # the tokens of that forward


def gpu_kv_bytes(memory: GpuMemory, utilization: float) -> int:
    """The KV pool's share of the device: utilization * total - in use - activation peak (may be <= 0)."""
    return int(utilization * memory.total) - memory.in_use - memory.activation_peak


@dataclass(frozen=True, slots=True)
class KVPoolSize:
    """The pool a server builds, and the reason for its size (``describe`` is the start-up log line)."""

    num_blocks: int
    block_size: int  # tokens per block
    bytes_per_block: int  # every layer, K and V
    dtype: str  # the KV cache's element type in words (kv_formats.describe)
    device: str
    reason: str  # which flag or default decided, with its numbers

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def describe(self) -> str:
        return (f"KV cache: {self.num_blocks} blocks = {self.tokens} tokens ({self.block_size} per block), "
                f"{human_bytes(self.nbytes)} ({self.nbytes} bytes), {self.dtype} on {self.device}; "
                f"sized by {self.reason}")


def size_kv_pool(flags: KVFlags, *, dtype: str, block_size: int, bytes_per_block: int,
                 measure_gpu: Callable[[], GpuMemory] | None = None) -> KVPoolSize:
    """The pool's size from the flags (the module's precedence). ``measure_gpu`` is called only
    when --gpu-memory-utilization decides. Raises ValueError with the numbers when the budget
    holds no block."""
    source = flags.source()
    if source == NUM_BLOCKS:
        blocks, reason = flags.num_blocks, f"--num-blocks {flags.num_blocks}"
    elif source == KV_CACHE_MEMORY:
        budget = flags.kv_cache_memory
        blocks = budget // bytes_per_block
        if blocks < 1:
            raise ValueError(f"--kv-cache-memory {budget} ({human_bytes(budget)}) holds no KV block: one block "
                             f"({block_size} tokens, K and V of every layer, {dtype}) takes {bytes_per_block} bytes")
        reason = f"--kv-cache-memory {human_bytes(budget)} ({budget} bytes) / {bytes_per_block} bytes per block"
    elif source == GPU_MEMORY_UTILIZATION:
        if measure_gpu is None:
            raise ValueError("--gpu-memory-utilization needs the device's memory measured (measure_gpu)")
        util, memory = flags.utilization, measure_gpu()
        budget = gpu_kv_bytes(memory, util)
        arithmetic = (f"{util:g} x {human_bytes(memory.total)} total ({memory.total}) - {human_bytes(memory.in_use)} "
                      f"in use after loading the weights ({memory.in_use}) - {human_bytes(memory.activation_peak)} "
                      f"activation peak of a {memory.profile_tokens}-token forward ({memory.activation_peak}) = "
                      f"{human_bytes(budget)} ({budget} bytes)")
        blocks = max(budget, 0) // bytes_per_block
        if blocks < 1:
            raise ValueError(f"--gpu-memory-utilization {util:g} leaves no memory for the KV cache on {flags.device}: "
                             f"{arithmetic}, less than one block ({bytes_per_block} bytes). Raise "
                             "--gpu-memory-utilization, free the GPU of other processes, lower --max-num-seqs or "
                             "--max-model-len, or size the pool with --kv-cache-memory or --num-blocks")
        default = " (the default)" if flags.gpu_memory_utilization is None else ""
        reason = f"--gpu-memory-utilization {util:g}{default}: {arithmetic} for KV"
    else:
        blocks = CPU_DEFAULT_BLOCKS
        reason = (f"the CPU default of {CPU_DEFAULT_BLOCKS} blocks (--kv-cache-memory BYTES sizes the pool from "
                  "bytes, --num-blocks N sets a count)")
    return KVPoolSize(blocks, block_size, bytes_per_block, dtype, flags.device, reason)


def profile_prompt_lengths(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    """The prompts of the engine's largest step: max_num_batched_tokens tokens (or one prompt of
    the whole context, which the scheduler admits alone whatever its size) in at most
    max_num_seqs prompts of at most max_model_len - 1 tokens."""
    longest = max_model_len - 1
    tokens = min(max(max_num_batched_tokens, longest), max_num_seqs * longest)
    full, rest = divmod(tokens, longest)
    return [longest] * full + ([rest] if rest else [])


def measure_gpu_memory(loaded, engine_config, cuda=None) -> GpuMemory:
    """With the weights loaded, run one profiling forward (the prompts of ``profile_prompt_lengths``,
    through a throwaway engine with a pool just big enough), read its activation peak, then what is
    in use once torch's cache is emptied. ``cuda``: the ``torch.cuda`` module (a fake in tests)."""
    import torch

    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, blocks_needed

    cuda = cuda or torch.cuda
    device = loaded.device
    cuda.synchronize(device)
    cuda.empty_cache()
    free, total = cuda.mem_get_info(device)
    max_len = engine_config.max_model_len or loaded.config.context_length
    lengths = profile_prompt_lengths(engine_config.max_num_batched_tokens, max_len, engine_config.max_num_seqs)
    block_size = engine_config.block_size
    probe = LLMEngine(loaded, EngineConfig(
        num_blocks=sum(blocks_needed(n, block_size) for n in lengths), block_size=block_size,
        max_num_seqs=len(lengths), max_model_len=max_len, enable_prefix_cache=False,
        max_num_batched_tokens=sum(lengths), long_prefill_threshold=0,  # one step: the serving engine's largest
        detokenize=False, cuda_graphs=False,  # the serving engine captures them
        kv_cache_dtype=engine_config.kv_cache_dtype))  # fp8: its quantizing writes' temporaries count too
    vocab = loaded.config.vocab_size
    prompts = [(f"profile-{i}", [(i + j) % vocab for j in range(n)], SamplingParams(max_tokens=1))
               for i, n in enumerate(lengths)]
    cuda.synchronize(device)
    cuda.reset_peak_memory_stats(device)
    before = cuda.memory_allocated(device)
    try:
        probe.pd.prefill_many(prompts)
        cuda.synchronize(device)
    except torch.OutOfMemoryError:
        raise ValueError(f"the profiling forward of {sum(lengths)} tokens ran out of memory on {device} "
                         f"({human_bytes(total - free)} of {human_bytes(total)} in use after loading the weights): "
                         "lower --max-num-seqs or --max-model-len, or use a larger GPU") from None
    peak = cuda.max_memory_allocated(device) - before
    for request_id, _, _ in prompts:
        probe.pd.release(request_id)
    del probe
    gc.collect()  # the throwaway engine's KV tensor, whatever cycles hold it
    cuda.empty_cache()
    free, total = cuda.mem_get_info(device)  # read again: the workspaces the CUDA libraries made in that forward stay
    return GpuMemory(total=total, in_use=total - free, activation_peak=max(peak, 0), profile_tokens=sum(lengths))
