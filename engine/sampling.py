"""The batched sampler (SamplingParams, what it reads: ``sampling_params.py``, imported here for its users).

Seeded sampling is reproducible *per position*: the random draw for the n-th generated token
of a request with ``seed=s`` depends only on (s, n). So a token sampled by a prefill process
and the following ones sampled by a decode process give exactly the colocated sequence, and a
request resumed after k tokens (``seed_position=k``) goes on with the draws k, k+1, ...
"""

from __future__ import annotations

import torch

from .logprobs import TokenLogprob
from .sampling_params import SamplingParams


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
