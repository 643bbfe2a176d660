"""SamplingParams (validated) and the batched sampler.

Seeded sampling is reproducible *per position*: the random draw for the n-th generated token
of a request with ``seed=s`` depends only on (s, n). So a token sampled by a prefill process
and the following ones sampled by a decode process give exactly the colocated sequence, and a
request resumed after k tokens (``seed_position=k``) goes on with the draws k, k+1, ...
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .grammar import GrammarSpec
from .logprobs import MAX_LOGPROBS, TokenLogprob


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


def _position_seed(seed: int, position: int) -> int:
    return (seed * 1_000_003 + position * 7_919 + 12_345) % (2**63 - 1)


class Sampler:
    """Picks one token per row of a logits batch ``[N, vocab]``."""

    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None):
        self.device = torch.device(device)
        self._gen = torch.Generator(device=self.device)
        if seed is not None:
            self._gen.manual_seed(seed)
        else:
            self._gen.seed()
        self._row_gen = torch.Generator(device=self.device)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
        """``positions[i]``: how many tokens row i's request has generated before this one."""
        out = [0] * len(params)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            if len(greedy) == len(params):
                return logits.argmax(dim=-1).tolist()
            ids = logits[greedy].argmax(dim=-1).tolist()
            for i, t in zip(greedy, ids):
                out[i] = t
        rand = [i for i, p in enumerate(params) if not p.greedy]
        if not rand:
            return out
        x = logits[rand].float()
        temps = torch.tensor([params[i].temperature for i in rand], device=x.device).unsqueeze(1)
        x = x / temps
        top_ks = [params[i].top_k for i in rand]
        if any(k > 0 for k in top_ks):
            vocab = x.shape[-1]
            ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=x.device)
            sorted_vals = x.sort(dim=-1, descending=True).values
            kth = sorted_vals.gather(1, (ks - 1).unsqueeze(1))
            x = x.masked_fill(x < kth, float("-inf"))
        top_ps = [params[i].top_p for i in rand]
        if any(p < 1.0 for p in top_ps):
            sorted_vals, sorted_idx = x.sort(dim=-1, descending=True)
            probs = sorted_vals.softmax(dim=-1)
            cum = probs.cumsum(dim=-1)
            ps = torch.tensor(top_ps, device=x.device).unsqueeze(1)
            drop_sorted = (cum - probs) >= ps  # keep the smallest set whose mass reaches top_p
            drop = torch.zeros_like(drop_sorted).scatter(1, sorted_idx, drop_sorted)
            x = x.masked_fill(drop, float("-inf"))
        probs = x.softmax(dim=-1)
        # Sample as argmax(p / E) with E ~ Exp(1) noise drawn from the row's own generator.
        noise = torch.empty_like(probs)
        for row, i in enumerate(rand):
            p = params[i]
            if p.seed is None:
                noise[row].exponential_(generator=self._gen)
            else:
                self._row_gen.manual_seed(_position_seed(p.seed, p.seed_position + positions[i]))
                noise[row].exponential_(generator=self._row_gen)
        ids = (probs / noise).argmax(dim=-1).tolist()
        for i, t in zip(rand, ids):
            out[i] = t
        return out


def token_logprobs(logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]) -> list[TokenLogprob | None]:
    """Each row's sampled token's logprob and its top ``params[i].logprobs`` alternatives, from the
    raw logits (log-softmax before temperature, filters and grammar); None for rows that did not ask."""
    asked = [(i, k) for i, p in enumerate(params) if (k := p.logprobs) is not None]
    rows = [i for i, _ in asked]
    out: list[TokenLogprob | None] = [None] * len(params)
    if not rows:
        return out
    found = logprobs_of(logits[rows], [tokens[i] for i in rows], [k for _, k in asked])
    for i, lp in zip(rows, found):
        out[i] = lp
    return out


ROWS_PER_PASS = 256  # logits rows put through log-softmax at once (a long prompt's rows go in slices)


def logprobs_of(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    """Row r's logprob of ``tokens[r]`` and its top ``ks[r]`` alternatives (log-softmax of the raw logits)."""
    out: list[TokenLogprob] = []
    for start in range(0, len(tokens), ROWS_PER_PASS):
        end = min(start + ROWS_PER_PASS, len(tokens))
        lp = torch.log_softmax(logits[start:end].float(), dim=-1)
        chosen = lp.gather(1, torch.tensor(tokens[start:end], device=lp.device).unsqueeze(1)).squeeze(1).tolist()
        k = max(ks[start:end])
        top_v, top_i = (lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
        values, ids = top_v.tolist(), top_i.tolist()
        for r in range(end - start):
            n = ks[start + r]
            out.append(TokenLogprob(tokens[start + r], chosen[r], tuple(zip(ids[r][:n], values[r][:n]))))
    return out
