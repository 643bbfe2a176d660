"""PipelineConfig: the settings of a PipelineEngine (stages, schedule, KV blocks, batches), checked
when made. No torch here: the CLI and the batch server read it without starting anything."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.defaults import BLOCK_SIZE

SCHEDULES = ("td-pipe", "mixed")


@dataclass
class PipelineConfig:
    num_stages: int = 2
    schedule: str = "td-pipe"
    num_blocks: int = 1024
    block_size: int = BLOCK_SIZE
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # tokens per micro-batch (prompt spans + decode rows): the Scheduler's budget
    # the most tokens of one prompt per micro-batch while a shorter prompt waits (0: the whole budget); a prompt
    # longer than the budget is computed in chunks either way (the one-process engine's EngineConfig has the same)
    long_prefill_threshold: int = 0
    max_model_len: int | None = None
    threads_per_stage: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    enable_prefix_cache: bool = False
    work_stealing: bool = True
    # micro-batches kept in flight (0: num_stages, the minimum that keeps every stage busy; one more
    # hides the controller's round trip: a stage finds the next micro-batch waiting when it finishes)
    micro_batches: int = 0
    # td-pipe: fewer decode micro-batches rather than ones under this many sequences (1: always depth)
    min_decode_batch: int = 1
    detokenize: bool = True  # fill RequestOutput.text (stop strings work either way)
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        for name in ("num_stages", "num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "threads_per_stage", "min_decode_batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.long_prefill_threshold < 0:
            raise ValueError(f"long_prefill_threshold must be >= 0 (0: the whole budget), got "
                             f"{self.long_prefill_threshold}")
        if self.micro_batches < 0:
            raise ValueError(f"micro_batches must be >= 0 (0: num_stages), got {self.micro_batches}")

    @property
    def depth(self) -> int:
        """Micro-batches in flight at most."""
        return self.micro_batches or self.num_stages
