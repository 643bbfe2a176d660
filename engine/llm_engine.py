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
With ``EngineConfig.tbt_slo_ms`` a decode's batch is bounded by its predicted step time
(``step_budget.py``: ``reserve`` refuses for now, ``add_prefilled`` waits to join).

The parts, each in its own module: ``Scheduler`` (queues, admission, preemption),
``ModelRunner`` (batch building, forward, sampling), ``OutputProcessor`` (stops, text,
RequestOutput), ``PDHooks``, ``SequenceFactory`` (input validation). What does not depend on the
model (admission, ``step``, ``abort``, the reads) is ``EngineCore``'s (``engine_core.py``), shared with
the simulated engine (``sim/``); this class adds the model, its KV tensor, the tiers and the swapper.

Not thread-safe: call from one thread (AsyncLLMEngine runs it on its own thread).
"""

from __future__ import annotations

import logging

from .block_manager import blocks_needed
from .decode_graphs import DecodeGraphs
from .engine_config import EngineConfig
from .engine_core import EngineCore
from .grammar import Grammars
from .kv_cache import KVCache
from .kv_tiers import KVTiers
from .loader import LoadedModel
from .model_runner import ModelRunner
from .sampling import Sampler
from .swap import Swapper
from .tp.rank_pools import RankPool
from .tp.ranks import TensorParallelSteps
from .tp.shard import Shard
from .tp.transfer import KVTransferPool

log = logging.getLogger(__name__)

__all__ = ["EngineConfig", "LLMEngine"]  # EngineConfig lives in engine_config.py; imported from here too


class LLMEngine(EngineCore):
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None):
        config = config or EngineConfig()
        cfg = loaded.config
        if config.tensor_parallel_size != loaded.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} but the model was loaded for "
                             f"{loaded.tensor_parallel_size} rank(s): load_model(..., tensor_parallel_size="
                             f"{config.tensor_parallel_size})")
        kv_shape = loaded.model.cfg  # this rank's heads (tp/shard.py): the whole model's at tensor-parallel size 1
        self.loaded, self.model_config = loaded, cfg
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        if config.max_model_len is not None and config.max_model_len > cfg.context_length:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's context length {cfg.context_length}"
            )
        max_model_len = config.max_model_len or cfg.context_length
        num_blocks = config.num_blocks
        if num_blocks is None:
            probe = KVCache(cfg.num_layers, 1, config.block_size, kv_shape.num_kv_heads, cfg.head_dim, loaded.dtype,
                            "meta", config.kv_cache_dtype)
            by_memory = config.kv_cache_bytes // (probe.block_nbytes * cfg.num_layers)
            by_need = config.max_num_seqs * blocks_needed(max_model_len, config.block_size)
            num_blocks = max(1, min(by_memory, by_need))
        self.kv_cache = KVCache(cfg.num_layers, num_blocks, config.block_size, kv_shape.num_kv_heads, cfg.head_dim,
                                loaded.dtype, loaded.device, config.kv_cache_dtype,
                                config.kv_cache_shared)
        self.sampler = Sampler(loaded.device, config.seed)
        self.device = loaded.device
        switches = dict(fused_elementwise=config.fused_elementwise, merged_projections=config.merged_projections,
                        packed_linear=config.packed_linear)
        self.model.configure(**switches)
        steps = None  # this process's model alone
        if config.tensor_parallel_size > 1:  # the other ranks started, each step sent to them (tp/ranks.py)
            steps = TensorParallelSteps.start(loaded, self.kv_cache, switches, config.tensor_parallel_timeout_s,
                                              config.tensor_parallel_shm,
                                              shared_pools=config.kv_transfer and config.kv_push_per_rank)
        runner = ModelRunner(self.model, self.kv_cache, self.sampler, self.device,
                             native_kernels=config.native_kernels, steps=steps)
        eos_ids = set(loaded.tokenizer.eos_token_ids) | set(cfg.eos_token_ids)
        self.grammars = Grammars(self.tokenizer, cfg.vocab_size, eos_ids)
        super().__init__(config, num_blocks, max_model_len, runner, vocab_size=cfg.vocab_size, eos_ids=eos_ids,
                         detokenizer=self.tokenizer.detokenizer, grammars=self.grammars)
        if config.kv_host_tier_bytes or config.kv_disk_tier_bytes or config.kv_disk_tier_dir:
            if not config.enable_prefix_cache:
                raise ValueError("KV tiers hold evicted prefix-cache blocks: they need the prefix cache on")
            self.tiers = KVTiers(self.kv_cache, config.kv_host_tier_bytes, config.kv_disk_tier_dir,
                                 config.kv_disk_tier_bytes)
            self.block_manager.tiers = self.tiers
        if config.cuda_graphs and DecodeGraphs.possible(self.device):
            self._capture_decode_graphs(config)
        self.swapper = Swapper(self.scheduler, self.kv_cache)  # evict to host memory / restore (swap.py)
        self.transfer: KVTransferPool | None = None
        # request ids whose KV the per-rank push put in every rank's pool (set by the decode's server before
        # add_prefilled; taken there): no scatter from the transfer pool for them (tp/rank_pools.py)
        self.kv_landed: set[str] = set()
        if steps is not None:
            self._tensor_parallel_kv(config, steps)

    def _tensor_parallel_kv(self, config: EngineConfig, steps: TensorParallelSteps) -> None:
        """Rank 0's pool holds only its KV heads: KV moves in and out through the transfer pool (P/D,
        ``config.kv_transfer``: tp/transfer.py) or not at all; never to host memory (the swapper)."""
        size = config.tensor_parallel_size
        self.swapper.kv_stays = (f"KV cannot move out of a tensor-parallel engine's pool to host memory (size {size}: "
                                 "each rank's pool holds only its KV heads)")
        if not config.kv_transfer:
            self.pd.kv_stays = (f"KV cannot move out of or into this tensor-parallel engine (size {size}: each rank's "
                                "pool holds only its KV heads; EngineConfig.kv_transfer makes its transfer pool)")
            return
        full = self.model_config
        heads = [Shard(r, size, full).kv_heads for r in range(size)]
        self.transfer = steps.transfer = KVTransferPool(self.kv_cache, full.num_kv_heads, heads,
                                                        shared=config.kv_cache_shared)
        steps.checksum = config.kv_checksum
        self.pd.install = self._install

    def _install(self, request_id: str, blocks: list[int]) -> None:
        """The decode's arrival: the blocks from the transfer pool to every rank, unless the per-rank push put them
        in every rank's pool already (``kv_landed``)."""
        if request_id in self.kv_landed:
            self.kv_landed.discard(request_id)
            return
        self.runner.steps.install(blocks)

    @property
    def rank_pools(self) -> list[RankPool]:
        """Every rank's KV pool for the per-rank push (``tp/rank_pools.py``), in rank order: this engine's pool at
        tensor-parallel size 1; [] when its ranks' pools are not mapped here (CUDA, ``kv_push_per_rank`` off)."""
        steps = self.runner.steps
        if isinstance(steps, TensorParallelSteps):
            return steps.rank_pools
        heads = range(self.model_config.num_kv_heads)
        return [RankPool(0, self.kv_cache.tensor, self.kv_cache.shared_fd, heads)]

    @property
    def kv_pushes(self) -> dict[str, int]:
        """Pushing steps by how their KV left the ranks ("gather" through rank 0, "per_rank"); {} at size 1."""
        steps = self.runner.steps
        return dict(steps.pushes) if isinstance(steps, TensorParallelSteps) else {}

    @property
    def tensor_parallel_lost(self) -> BaseException | None:
        """Why the tensor-parallel ranks are lost for good (a rank died or hung: tp/ranks.py), or None."""
        return getattr(self.runner.steps, "lost", None)

    @property
    def transfer_cache(self) -> KVCache:
        """The pool KV moves in and out of (the CacheStore's region): the KV cache, or with tensor parallelism
        rank 0's transfer pool (every KV head of every block)."""
        return self.kv_cache if self.transfer is None else self.transfer.cache

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

    def close(self) -> None:
        """Delete what the KV tiers hold (the disk tier's directory too) and stop the other tensor-parallel
        ranks. Also done at exit."""
        if self.tiers is not None:
            self.tiers.close()
        self.runner.steps.close()

