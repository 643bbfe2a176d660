"""SimEngine: EngineCore (the real BlockManager, Scheduler, outputs and P/D primitives) over a SimRunner.

Everything but the step's computation is the built-in engine's: admission, chunked prefill, the prefix
cache and its eviction, preemption, the P/D holds and reservations, stop strings. The KV pool is
bookkeeping only (block ids); the CacheStore's region is the runtime's (``pdserve/server_setup.py``),
sized from ``kv_cache`` (``SimKVShape``: the pool's shape without a tensor).

Not here: KV tiers and the decode's swap to host memory (``swapper`` is a ``NoSwapper``: nothing is ever
swapped), constrained output (a request with a grammar is refused, naming the sim), tensor parallelism.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from ..block_manager import blocks_needed
from ..engine_config import EngineConfig
from ..engine_core import EngineCore
from .profile import SimProfile
from .runner import SimRunner, printable_vocabulary

NO_GRAMMAR = ("--engine sim does not do constrained output (response_format, tools): its tokens are a hash of "
              "the context, not a model's")


@dataclass(frozen=True, slots=True)
class SimKVShape:
    """The pool's shape (what the built-in engine's KVCache says of its tensor)."""

    num_layers: int
    num_blocks: int
    block_size: int
    block_nbytes: int  # one block of one layer, K and V


class NoSwapper:
    """The decode's LSO reads the swapped requests here: the sim never swaps any out."""

    kv_stays = "the simulated engine keeps no KV to swap out"

    def swapped_ids(self) -> list[str]:
        return []

    def swapped_bytes(self) -> int:
        return 0

    def evict(self, request_id: str) -> int:
        return 0

    def restore(self, request_id: str) -> bool:
        return False


class NoGrammars:
    def matcher(self, spec, prompt_ids):
        raise ValueError(NO_GRAMMAR)

    def check(self, spec) -> None:
        raise ValueError(NO_GRAMMAR)


class SimEngine(EngineCore):
    def __init__(self, profile: SimProfile, tokenizer, config: EngineConfig | None = None,
                 sleep: Callable[[float], None] = time.sleep):
        """``tokenizer``: the served model's (``tokenizer.ByteTokenizer`` or ``HFTokenizer``): its
        detokenizer makes the text and its EOS ids join the profile's. ``config.num_blocks`` None: room
        for ``max_num_seqs`` full-length requests."""
        config = config or EngineConfig()
        model = profile.model
        if config.max_model_len is not None and config.max_model_len > model.context_length:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the profile's context length "
                             f"{model.context_length} ({profile.name})")
        if config.kv_host_tier_bytes or config.kv_disk_tier_bytes or config.kv_disk_tier_dir:
            raise ValueError("--engine sim has no KV tiers (--kv-host-tier-bytes, --kv-disk-tier-*)")
        if config.tensor_parallel_size != 1:
            raise ValueError("--engine sim runs at --tensor-parallel-size 1 (a profile is one engine's time)")
        max_model_len = config.max_model_len or model.context_length
        num_blocks = config.num_blocks or config.max_num_seqs * blocks_needed(max_model_len, config.block_size)
        self.profile, self.tokenizer = profile, tokenizer
        eos_ids = set(model.eos_token_ids) | set(tokenizer.eos_token_ids)
        runner = SimRunner(profile, printable_vocabulary(model.vocab_size, eos_ids), sleep)
        super().__init__(config, num_blocks, max_model_len, runner, vocab_size=model.vocab_size, eos_ids=eos_ids,
                         detokenizer=tokenizer.detokenizer, grammars=NoGrammars())
        self.kv_cache = SimKVShape(model.num_layers, num_blocks, config.block_size,
                                   model.kv_bytes_per_token * config.block_size // model.num_layers)
        self.swapper = NoSwapper()

    def close(self) -> None:
        """Nothing to free (the built-in engine's ``close`` deletes its tiers)."""
