"""LLMEngine: continuous batching over a paged KV cache; its P/D primitives are ``engine.pd``.

Colocated path (the baseline and the prefill server's local fallback)::

    engine.add_request(rid, prompt_ids, sampling)
    while engine.has_unfinished():
        for out in engine.step(): ...          # RequestOutput per request that produced something

Each ``step`` (1) gives every running sequence at a decode row a slot for its next token,
preempting the newest colocated sequence (freeing its blocks; it is recomputed later) when blocks
run out, (2) gives prompts part-way their next chunk and admits waiting requests in order while
blocks, ``max_num_seqs`` and the step's token budget allow (chunked prefill: a prompt longer than
``long_prefill_threshold`` takes several steps; a request that does not fit waits; one that could
never fit is refused by ``add_request``), (3) runs ONE forward over all of them (prefill chunks and
decode rows together) and samples where a prompt's last chunk or a decode row ends. One scheduler
for every request: a P/D remote prefill (``engine.pd.add_remote``) and the decode side's
``prefill_reserved`` are scheduled, chunked and batched the same way (``scheduler.py``).

P/D: ``engine.pd`` (a ``PDHooks``, ``pd_hooks.py``) holds ``add_remote``, ``prefill_only``,
``prefill_many``, ``release``; ``reserve``, ``reserve_prefix``, ``add_prefilled``, ``prefill_reserved`` and their
contract, over this engine's scheduler, runner and outputs; ``abort`` here frees what they hold.

The parts, each in its own module: ``Scheduler`` (queues, admission, preemption),
``ModelRunner`` (batch building, forward, sampling), ``OutputProcessor`` (stops, text,
RequestOutput), ``PDHooks``, ``SequenceFactory`` (input validation).

Not thread-safe: call from one thread (AsyncLLMEngine runs it on its own thread).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from .block_manager import BlockManager, blocks_needed
from .decode_graphs import DecodeGraphs
from .defaults import BLOCK_SIZE, LONG_PREFILL_THRESHOLD, MAX_NUM_BATCHED_TOKENS
from .errors import OutOfBlocksError
from .grammar import Grammars
from .kv_cache import KVCache
from .kv_formats import check_kv_dtype
from .kv_tiers import KVTiers, TierStats
from .loader import LoadedModel
from .model_runner import ModelRunner
from .outputs import OutputProcessor, take_output
from .pd_hooks import PDHooks
from .remote_prefill import PrefillAborted, layer_callback
from .sampling import Sampler, SamplingParams
from .scheduler import Scheduler
from .sequence import RequestOutput, Sequence, SequenceFactory, Status
from .swap import Swapper
from .tp.ranks import TensorParallelSteps

log = logging.getLogger(__name__)


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
    packed_linear: bool = True  # CPU: oneDNN-packed copies of the linear weights for batches (packed_linear.py)
    fused_elementwise: bool = True  # CUDA: RMSNorm, rotary, silu*mul as one Triton kernel each (gpu_elementwise.py)
    merged_projections: bool = True  # CUDA: q|k|v and gate|up as one matmul each (models/llama.py)
    # tensor parallelism (tp/): the ranks the model is split over, one process each; the model must be loaded
    # for as many (load_model(..., tensor_parallel_size=N): rank 0's shard); this process is rank 0 and starts
    # the others. tensor_parallel_timeout_s bounds how long a step waits on a rank that hangs
    tensor_parallel_size: int = 1
    tensor_parallel_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        check_kv_dtype(self.kv_cache_dtype)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.long_prefill_threshold < 0:
            raise ValueError(f"long_prefill_threshold must be >= 0 (0: the whole budget), got "
                             f"{self.long_prefill_threshold}")
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


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None):
        config = config or EngineConfig()
        cfg = loaded.config
        if config.tensor_parallel_size != loaded.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} but the model was loaded for "
                             f"{loaded.tensor_parallel_size} rank(s): load_model(..., tensor_parallel_size="
                             f"{config.tensor_parallel_size})")
        kv_shape = loaded.model.cfg  # this rank's heads (tp/shard.py): the whole model's at tensor-parallel size 1
        self.loaded, self.config, self.model_config = loaded, config, cfg
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        if config.max_model_len is not None and config.max_model_len > cfg.context_length:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's context length {cfg.context_length}"
            )
        self.max_model_len = config.max_model_len or cfg.context_length
        self.block_size = config.block_size
        num_blocks = config.num_blocks
        if num_blocks is None:
            probe = KVCache(cfg.num_layers, 1, config.block_size, kv_shape.num_kv_heads, cfg.head_dim, loaded.dtype,
                            "meta", config.kv_cache_dtype)
            by_memory = config.kv_cache_bytes // (probe.block_nbytes * cfg.num_layers)
            by_need = config.max_num_seqs * blocks_needed(self.max_model_len, config.block_size)
            num_blocks = max(1, min(by_memory, by_need))
        self.kv_cache = KVCache(cfg.num_layers, num_blocks, config.block_size, kv_shape.num_kv_heads, cfg.head_dim,
                                loaded.dtype, loaded.device, config.kv_cache_dtype)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_cache)
        self.tiers: KVTiers | None = None
        if config.kv_host_tier_bytes or config.kv_disk_tier_bytes or config.kv_disk_tier_dir:
            if not config.enable_prefix_cache:
                raise ValueError("KV tiers hold evicted prefix-cache blocks: they need the prefix cache on")
            self.tiers = KVTiers(self.kv_cache, config.kv_host_tier_bytes, config.kv_disk_tier_dir,
                                 config.kv_disk_tier_bytes)
            self.block_manager.tiers = self.tiers
        self.sampler = Sampler(loaded.device, config.seed)
        self.device = loaded.device
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.long_prefill_threshold)
        self.stalled = False  # the last step had work waiting but could schedule none of it (no free blocks)
        switches = dict(fused_elementwise=config.fused_elementwise, merged_projections=config.merged_projections,
                        packed_linear=config.packed_linear)
        self.model.configure(**switches)
        steps = None  # this process's model alone
        if config.tensor_parallel_size > 1:  # the other ranks started, each step sent to them (tp/ranks.py)
            steps = TensorParallelSteps.start(loaded, self.kv_cache, switches, config.tensor_parallel_timeout_s)
        self.runner = ModelRunner(self.model, self.kv_cache, self.sampler, self.device,
                                  native_kernels=config.native_kernels, steps=steps)
        if config.cuda_graphs and self.device.type == "cuda":
            self._capture_decode_graphs(config)
        self.outputs = OutputProcessor(set(loaded.tokenizer.eos_token_ids) | set(cfg.eos_token_ids), self.max_model_len)
        self.grammars = Grammars(self.tokenizer, cfg.vocab_size, self.outputs.eos_ids)
        self.factory = SequenceFactory(cfg.vocab_size, self.max_model_len, self.tokenizer.detokenizer,
                                       config.detokenize, self.scheduler.in_use, self.grammars)
        # the P/D primitives, called as engine.pd.reserve(...) etc. (pd_hooks.py)
        self.pd = PDHooks(self.scheduler, self.factory, self.outputs, self.max_model_len, self.step)
        self.swapper = Swapper(self.scheduler, self.kv_cache)  # evict to host memory / restore (swap.py)
        if config.tensor_parallel_size > 1:  # rank 0's pool holds only its KV heads: nothing moves in or out
            self.pd.kv_stays = self.swapper.kv_stays = (
                f"KV cannot move out of or into a tensor-parallel engine yet (size {config.tensor_parallel_size}: "
                "each rank's pool holds only its KV heads): compute prompts where they decode")

    def _capture_decode_graphs(self, config: EngineConfig) -> None:
        """CUDA graphs for pure-decode steps up to max_num_seqs rows; a failed capture leaves the engine eager.
        Only with the paged kernels: attention.py's decode gathers the whole table width, which a graph
        would have to hold for every row at the model's full length."""
        if self.config.tensor_parallel_size > 1:
            log.warning("decode CUDA graphs off: tensor parallelism runs every step eagerly (graphs per rank are not "
                        "built yet)")
            return
        if self.runner.attention != "triton":
            log.warning("decode CUDA graphs off: the paged attention kernels do not take this cache "
                        "(gpu_attention.usable: block size %d, head dim %d, triton importable?); decode runs eagerly",
                        config.block_size, self.model_config.head_dim)
            return
        host_bound = sorted({type(layer).__name__ for layer in self.model.layers if not layer.graph_capturable})
        if host_bound:
            log.warning("decode CUDA graphs off: %s reads device values on the host every step (a MoE layer picks "
                        "its experts there); decode runs eagerly", ", ".join(host_bound))
            return
        graphs = DecodeGraphs(self.model, self.kv_cache, config.max_num_seqs,
                              blocks_needed(self.max_model_len, config.block_size), attention="triton")
        try:
            graphs.capture()
        except Exception as exc:  # an op that cannot be captured: serve eagerly, and say so
            log.warning("decode CUDA graphs not captured, decode runs eagerly: %s: %s", type(exc).__name__, exc)
            return
        self.runner.graphs = graphs

    # ---- public queries --------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks()

    def prefix_hit_tokens(self) -> int:
        """Prompt tokens reused from the prefix cache since start (a counter)."""
        return self.block_manager.prefix_hits * self.block_manager.block_size

    def tier_stats(self) -> dict[str, TierStats]:
        """Tier name ("host", "disk") -> a copy of its running totals; empty without tiers."""
        return {} if self.tiers is None else {n: replace(t) for n, t in self.tiers.stats().items()}

    def close(self) -> None:
        """Delete what the KV tiers hold (the disk tier's directory too) and stop the other tensor-parallel
        ranks. Also done at exit."""
        if self.tiers is not None:
            self.tiers.close()
        self.runner.steps.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def num_requests(self) -> int:
        """Requests holding engine state: waiting, running, prefilled-and-held, or reserved."""
        return self.scheduler.num_requests()

    def request_ids(self) -> list[str]:
        """Ids of every request holding engine state (waiting, running, held, or reserved)."""
        return self.scheduler.request_ids()

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def num_preemptions(self) -> int:
        """Colocated sequences freed and recomputed for lack of blocks."""
        return self.scheduler.num_preemptions

    @property
    def eos_ids(self) -> set[int]:
        """Token ids that end a request (unless ``ignore_eos``): the tokenizer's and the config's."""
        return self.outputs.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: set[int]) -> None:
        self.outputs.eos_ids = ids

    # ---- colocated path --------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Queue a request. Raises PromptTooLongError, OutOfBlocksError (can never fit), ValueError."""
        seq = self.factory.make(request_id, prompt_token_ids, sampling)
        need = blocks_needed(min(len(seq.prompt_ids) + sampling.max_tokens, self.max_model_len), self.block_size)
        if need > self.num_blocks:
            raise OutOfBlocksError(
                f"request {request_id!r} needs {need} KV blocks ({len(seq.prompt_ids)} prompt tokens + "
                f"max_tokens {sampling.max_tokens}) but the pool has only {self.num_blocks}"
            )
        self.scheduler.add(seq)

    def abort(self, request_id: str, error: str = "aborted") -> bool:
        """Forget a request wherever it is and free its blocks. False if unknown. A remote prefill not yet
        prefilled hears ``error`` (``PrefillAborted``)."""
        seq = self.scheduler.seqs.get(request_id)
        found = self.scheduler.remove(request_id)
        if seq is not None and seq.remote is not None:
            seq.remote.finish(None, PrefillAborted(f"request {request_id!r}: {error}"))
        return found

    def abort_all(self) -> None:
        """Abort every request holding engine state (waiting, running, held, reserved)."""
        for request_id in self.request_ids():
            self.abort(request_id, "the engine stopped")

    def fail_scheduled(self, error: str) -> list[RequestOutput]:
        """Abort every waiting or running request after a failed step; one finished
        RequestOutput each (finish_reason "abort", ``error`` set; a remote prefill hears it through its
        ``on_done``). Held and reserved requests stay."""
        failed = list(self.scheduler.running) + list(self.scheduler.waiting)
        for seq in failed:
            self.abort(seq.request_id, error)
        return [RequestOutput(seq.request_id, [], True, "abort", error=error) for seq in failed if seq.remote is None]

    def step(self) -> list[RequestOutput]:
        """One scheduled forward pass (prefill chunks and decode rows) and what it produced."""
        outputs = self.pd.other_outputs + [take_output(seq) for seq in self.scheduler.take_done_early()]
        self.pd.other_outputs = []
        batch = self.scheduler.schedule()
        self.stalled = not batch and self.scheduler.has_unfinished() and not outputs
        if batch:
            self._run(batch)
        for seq in batch:
            if seq.remote is not None:
                continue  # finished (held) or failed in _run; its caller hears on_done
            if seq.status is Status.FINISHED:
                self.scheduler.finish(seq)
                outputs.append(take_output(seq))
            elif seq.pending_ids or seq.pending_text:
                outputs.append(take_output(seq))
        return outputs

    def _run(self, batch: list[Sequence]) -> None:
        """The step's forward pass; each sequence's chunk counted as computed, its token appended (or, for
        a remote prefill, its KV handed on and its first token reported: ``pd_hooks.py``)."""
        started = time.perf_counter()
        tokens, logprobs, prompt_lps = self.runner.forward_sample(batch, layer_callback(batch, self.block_size))
        self.pd.count_step(batch, time.perf_counter() - started)
        for seq, token, logprob, prompt_lp in zip(batch, tokens, logprobs, prompt_lps):
            if prompt_lp is not None:
                seq.prompt_logprobs = (seq.prompt_logprobs or []) + prompt_lp
            if seq.remote is not None:
                self.pd.remote_stepped(seq, token, logprob)
                continue
            seq.num_computed, seq.num_new = seq.chunk_end, 0
            self.scheduler.register_blocks(seq)
            if token is not None:  # None: a chunk before the prompt's last
                self.outputs.append_token(seq, token, logprob)
