"""Errors the engine raises for bad input or exhausted resources.

All derive from ValueError or RuntimeError with a message a user can act on; the HTTP layer
turns ``ValueError`` subclasses (bad sampling values, prompt too long) into 400s.
"""

from __future__ import annotations


class OutOfBlocksError(RuntimeError):
    """Not enough free KV blocks. ``reason`` says how many were needed and how many are free."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class TbtBoundError(OutOfBlocksError):
    """A decode with a TBT bound (``EngineConfig.tbt_slo_ms``) has no room for one more request now: the step
    predicted with it would be over the bound. Busy now, as out of blocks: a prefill waits and asks again."""

    code = "tbt_bound"


class PromptTooLongError(ValueError):
    """The prompt (plus at least one generated token) does not fit the model's context."""

    def __init__(self, num_prompt_tokens: int, max_model_len: int):
        super().__init__(
            f"prompt has {num_prompt_tokens} tokens but the maximum context length is {max_model_len} "
            f"(prompt plus at least one generated token must fit)"
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len


class ConfigError(ValueError):
    """A config.json the engine cannot run (unknown architecture, bad values)."""


class ModelLoadError(ValueError):
    """A checkpoint the loader cannot use: a missing or mis-shaped tensor, no weights, bad files."""


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, hung past its timeout, or could not start: the engine cannot step
    any more (every later step raises this again). The message names the rank where it is known."""


class ShardChecksumError(ValueError):
    """A tensor-parallel rank's shard of some KV blocks did not arrive intact at the other end of rank 0's hop
    (``EngineConfig.kv_checksum``: tp/transfer.py): the requests whose KV it is fail; the ranks stay in step."""
