"""Sequence (one request's state inside the engine), RequestOutput (what a step reports), and
SequenceFactory (a request's user input validated into a Sequence).

Invalid input raises ValueError (or PromptTooLongError, a ValueError) with a message naming
the field; nothing is changed in the engine when it does.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from .errors import PromptTooLongError
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from .grammar import Matcher
    from .remote_prefill import RemotePrefill
    from .tokenizer import Detokenizer


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
    logprobs: list | None = None  # one TokenLogprob per new token when the request asked (SamplingParams.logprobs)
    # SamplingParams.prompt_logprobs: one entry per prompt token (None for the first, then a TokenLogprob of
    # token i given the tokens before it), in the request's first output only
    prompt_logprobs: list | None = None


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # evicted to host memory (swap.py), out of the batch until restored
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
    detok: Detokenizer | None = None
    pending_ids: list[int] = field(default_factory=list)  # produced, not yet reported
    pending_text: str = ""
    emitted_len: int = 0  # characters of detok.text already put into outputs
    swapped_kv: torch.Tensor | None = None  # SWAPPED: its KV on the host (swap.py)
    pending_logprobs: list = field(default_factory=list)  # TokenLogprob of each pending id (when asked)
    matcher: Matcher | None = None  # when the request has a grammar
    first_logprob: object = None  # prefill_only: the first token's TokenLogprob (when asked)
    prompt_logprobs: list | None = None  # SamplingParams.prompt_logprobs: one entry per prompt token computed so far
    prompt_logprobs_sent: bool = False  # in an output already
    # set by the Scheduler for one step: how many of its uncomputed tokens this step computes (a prefill chunk, or
    # 1 for a decode row); a chunk that stops before the prompt's end samples nothing
    num_new: int = 0
    priority: float = 0.0  # the order among waiting requests: lower first, then arrival (SLO queue's order)
    remote: RemotePrefill | None = None  # P/D prefill side: its KV is pushed, and it is held once prefilled

    all_ids: list[int] = field(default_factory=list)  # prompt + output, kept in step (read-only for callers)

    def __post_init__(self) -> None:
        self.all_ids = self.prompt_ids + self.output_ids

    def append_output(self, token: int) -> None:
        self.output_ids.append(token)
        self.all_ids.append(token)

    @property
    def num_tokens(self) -> int:
        return len(self.all_ids)

    @property
    def chunk_end(self) -> int:
        """Where this step's computation ends: after its ``num_new`` tokens (unset: every token left)."""
        return self.num_computed + self.num_new if self.num_new else self.num_tokens

    @property
    def needs_prompt_logits(self) -> bool:
        """The request asked for prompt logprobs and not all are computed: its prefill keeps the logits
        of every prompt position, so none may be skipped by the prefix cache."""
        return self.sampling.prompt_logprobs is not None and len(self.prompt_logprobs or ()) < len(self.prompt_ids)


class SequenceFactory:
    """Validates a request (id, prompt ids, SamplingParams) and builds its Sequence.

    ``in_use(request_id)`` says whether an id is taken; ``detokenizer()`` makes the
    incremental detokenizer a sequence needs when ``detokenize`` is on or it has stop strings.
    Arrival numbers (the preemption order) count up from 1.
    """

    def __init__(self, vocab_size: int, max_model_len: int, detokenizer: Callable[[], Detokenizer], detokenize: bool,
                 in_use: Callable[[str], bool], grammars=None):
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.detokenizer, self.detokenize, self.in_use = detokenizer, detokenize, in_use
        self.grammars = grammars  # grammar.Grammars: a matcher for requests with a grammar
        self.arrivals = 0

    def make(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
             check_unique: bool = True) -> Sequence:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if check_unique and self.in_use(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("prompt must contain at least one token")
        vocab = self.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(ids) + 1 > self.max_model_len:
            raise PromptTooLongError(len(ids), self.max_model_len)
        self.arrivals += 1
        matcher = None
        if sampling.grammar is not None:
            if self.grammars is None:
                raise ValueError("this engine has no grammar support")
            matcher = self.grammars.matcher(sampling.grammar, ids)
        seq = Sequence(request_id, ids, sampling, self.arrivals)
        seq.matcher = matcher
        if self.detokenize or sampling.stop:
            seq.detok = self.detokenizer()
        return seq
