"""SamplingParams: how to pick a request's tokens and when to stop, validated (torch-free: the
servers and the simulated engine (``sim/``) read it without loading torch; ``sampling.py``'s Sampler uses it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .grammar import GrammarSpec
from .logprobs import MAX_LOGPROBS


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Bad values raise ValueError naming the field.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1.0 disable those filters.
    Stop: any id in ``stop_token_ids`` or (unless ``ignore_eos``) the model's EOS ids; any
    string of ``stop`` in the generated text (the text is cut before it); ``max_tokens``
    generated tokens (reason "length"). Stop tokens are not part of the output.
    ``logprobs``: report each output token's logprob and its ``logprobs`` most likely
    alternatives (0: none; None: no logprobs). ``prompt_logprobs``: the same for every prompt
    token given the tokens before it (the first has none), reported once with the first output;
    such a request computes its whole prompt (no prefix-cache reuse). ``grammar``: hold the output
    to a grammar (``grammar.py``; the sampler only picks tokens it allows). ``seed_position``: where
    the request's first generated token sits in its seeded random stream (a request resumed after n
    tokens, sent again as part of its prompt: n), so it draws what the uninterrupted request would have.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    grammar: GrammarSpec | None = None
    prompt_logprobs: int | None = None
    seed_position: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not self.temperature >= 0:  # also catches NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise ValueError(f"top_p must be a number, got {self.top_p!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        if isinstance(self.seed_position, bool) or not isinstance(self.seed_position, int) or self.seed_position < 0:
            raise ValueError(f"seed_position must be a non-negative integer, got {self.seed_position!r}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError(f"grammar must be a GrammarSpec, got {type(self.grammar).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
