"""EngineConfig: an engine's sizes and switches, validated (torch-free: the simulated engine (``sim/``)
takes the same sizes; ``llm_engine.py``'s LLMEngine reads every field)."""

from __future__ import annotations

from dataclasses import dataclass

from .defaults import BLOCK_SIZE, LONG_PREFILL_THRESHOLD, MAX_NUM_BATCHED_TOKENS
from .kv_formats import check_kv_dtype


@dataclass(slots=True)
class EngineConfig:
    """Engine sizes. ``num_blocks=None``: as many blocks as ``kv_cache_bytes`` holds, at most
    enough for ``max_num_seqs`` full-length sequences. ``max_model_len=None``: the model's context."""

    num_blocks: int | None = None
    block_size: int = BLOCK_SIZE
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_cache: bool = True
    # tokens one step computes, prefill chunks and decode rows together (chunked prefill: a longer prompt takes
    # several steps), and the most of them a long prompt takes in a step while a short prompt waits (0: the whole
    # budget), so the short one passes it after at most one of its chunks (a threshold above the budget is the budget)
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS
    long_prefill_threshold: int = LONG_PREFILL_THRESHOLD
    # prompts share a step only up to this many prompt tokens together (0: up to the budget). Where a step's time
    # grows with its tokens (a CPU), sharing delays the first prompt's first token by the others' compute: there a
    # prompt runs alone, and a short prompt passes a long one part-way in a step of its own (scheduler.py). The
    # servers choose it once by device (pdserve/server_args.py: SOLO_PROMPT_TOKENS_CPU on a CPU, 0 on CUDA)
    solo_prompt_tokens: int = 0
    kv_cache_bytes: int = 1 << 30
    seed: int | None = None  # the sampler's generator for requests without their own seed
    detokenize: bool = True  # fill RequestOutput.text (stop strings work either way)
    # prefix-cache tiers below the pool (engine/kv_tiers.py): 0 / None = off
    kv_host_tier_bytes: int = 0
    kv_disk_tier_dir: str | None = None
    kv_disk_tier_bytes: int = 0
    # on CUDA: decode steps from CUDA graphs (decode_graphs.py); False: eager (--enforce-eager)
    cuda_graphs: bool = True
    # "auto": K/V in the model's dtype; "fp8": float8_e4m3fn with a bfloat16 scale per token per KV head
    # (kv_quant.py; about twice the tokens in the same bytes)
    kv_cache_dtype: str = "auto"
    # Engine switches, read once here (each on by default; off for A/B runs and debugging). An engine applies
    # them to the model it runs (DecoderModel.configure), so engines sharing one loaded model share them.
    native_kernels: bool = True  # CPU: decode attention by the C++ kernel over the paged cache (native.py)
    packed_linear: bool = True  # CPU: packed copies of the linear weights, MKL's or oneDNN's (packed_linear.py)
    fused_elementwise: bool = True  # CUDA: RMSNorm, rotary, silu*mul as one Triton kernel each (gpu_elementwise.py)
    merged_projections: bool = True  # CUDA: q|k|v and gate|up as one matmul each (models/llama.py)
    # tensor parallelism (tp/): the ranks the model is split over, one process each; the model must be loaded
    # for as many (load_model(..., tensor_parallel_size=N): rank 0's shard); this process is rank 0 and starts
    # the others. tensor_parallel_timeout_s bounds how long a step waits on a rank that hangs
    tensor_parallel_size: int = 1
    tensor_parallel_timeout_s: float = 60.0
    # tensor parallelism and P/D: KV moves out of (a prefill's push) or into (a decode's arrival) this engine's
    # pool through rank 0's transfer pool, the whole model's KV heads for every block (tp/transfer.py; its
    # memory is the cost). False: a TP engine refuses to move KV. No effect at tensor_parallel_size 1
    kv_transfer: bool = False
    # with kv_transfer at tensor_parallel_size > 1 on the CPU: every rank's pool in shared memory, mapped by rank 0
    # (tp/rank_pools.py), so each rank's KV head shard can move on its own CacheStore link (the per-rank push:
    # the servers' --kv-push). The transfer pool stays, for peers that pair only through it
    kv_push_per_rank: bool = True
    # with kv_transfer at tensor_parallel_size > 1: each rank's KV shard summed (CRC32C) on both sides of rank 0's
    # hop (tp/transfer.py; the servers' --kv-checksum, whose wire checksums cover the rest of the way)
    kv_checksum: bool = False
    # CPU ranks: a decode step's all-reduces and logits gather through shared memory (tp/shm_collectives.py),
    # not gloo's loopback TCP (False: gloo for all; larger tensors go by gloo either way)
    tensor_parallel_shm: bool = True
    # CPU: the KV pool in shared memory (kv_shared.py: a memfd, mode 0600) so that a prefill process on this
    # machine can map it and write KV straight into it (the CacheStore's same-node transport); no effect on cuda
    kv_cache_shared: bool = False
    # a decode's TBT bound (step_budget.py): a request whose KV is in joins the running batch only while the step
    # time predicted with it (an online fit of this engine's own steps) stays within this many ms; 0: no bound
    tbt_slo_ms: float = 0.0
    # debug: keep a record of the last this many steps (step_trace.py: what happened in and just before each);
    # 0: off
    step_trace: int = 0

    def __post_init__(self) -> None:
        check_kv_dtype(self.kv_cache_dtype)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.solo_prompt_tokens < 0:
            raise ValueError(f"solo_prompt_tokens must be >= 0 (0: prompts share a step up to the budget), got "
                             f"{self.solo_prompt_tokens}")
        if self.long_prefill_threshold < 0:
            raise ValueError(f"long_prefill_threshold must be >= 0 (0: the whole budget), got "
                             f"{self.long_prefill_threshold}")
        if not self.tbt_slo_ms >= 0:
            raise ValueError(f"tbt_slo_ms must be >= 0 (0: no bound), got {self.tbt_slo_ms}")
        if self.step_trace < 0:
            raise ValueError(f"step_trace must be >= 0 (0: off), got {self.step_trace}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and (self.kv_host_tier_bytes or self.kv_disk_tier_bytes
                                              or self.kv_disk_tier_dir):
            raise ValueError("KV tiers with tensor parallelism are not built yet (they would copy rank 0's KV heads "
                             "only): use tensor_parallel_size 1 or no KV tiers")
