"""Sequence (one request's state inside the engine) and RequestOutput (what a step reports)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .sampling import SamplingParams


@dataclass(slots=True)
class RequestOutput:
    """Tokens a request produced in one step.

    ``new_token_ids``: generated tokens since the last output (stop tokens excluded).
    ``text``: their text delta (never splits a UTF-8 character; cut before a stop string).
    ``finish_reason``: "stop" (EOS, stop token or stop string), "length" (max_tokens or the
    context is full), "abort", or None while running. ``error`` is set when the engine failed
    the request (finish_reason "abort").
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    text: str = ""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival: int
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    reserved: bool = False  # P/D decode side: all blocks reserved up front, never preempted
    status: Status = Status.WAITING
    finish_reason: str | None = None
    detok: object = None
    pending_ids: list[int] = field(default_factory=list)  # produced, not yet reported
    pending_text: str = ""
    emitted_len: int = 0  # characters of detok.text already put into outputs

    all_ids: list[int] = field(default_factory=list)  # prompt + output, kept in step (read-only for callers)

    def __post_init__(self) -> None:
        self.all_ids = self.prompt_ids + self.output_ids

    def append_output(self, token: int) -> None:
        self.output_ids.append(token)
        self.all_ids.append(token)

    @property
    def num_tokens(self) -> int:
        return len(self.all_ids)
