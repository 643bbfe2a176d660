"""SimRunner: the simulated engine's step: modelled time, deterministic tokens, the per-layer KV callback.

``forward_sample(batch, on_layer)`` (the runner contract of ``engine_core.py``) for a batch the real
Scheduler built:

1. each sequence is a prefill chunk ``(new, cached)`` (``new = chunk_end - num_computed``, ``cached =
   num_computed``: a prefix hit or an earlier chunk) or a decode row (one token left, some computed:
   ``model_runner._decode_row``'s rule) of context ``num_computed + 1``;
2. the step lasts ``profile.step.step_s(chunks, contexts)``, spent as ``num_layers`` equal sleeps, with
   ``on_layer(layer)`` after each when given (the P/D prefill's layer-wise KV push runs as with the model);
3. every sequence whose span reaches its last token gets the token ``next_token(all_ids[:n])``:
   a function of the context alone (a rolling hash of its ids), so a prompt gives the same tokens
   colocated, on a P/D pair, or resumed elsewhere; chunks before a prompt's last get None.

Tokens are drawn from ``vocabulary`` (printable ASCII for the byte vocabulary, else every id but the
EOS ids): the sim never ends a request by EOS, so a request runs to ``max_tokens`` or a stop string.
Sampling parameters other than those stops are not read (temperature, seeds, top-k give the same
tokens). Logprobs, when asked: 0.0 for the token, then the next ids of the vocabulary at -30.0.
``sleep`` is injectable (tests record the modelled seconds instead of sleeping).
"""

from __future__ import annotations

import time
from typing import Callable

from ..logprobs import TokenLogprob
from ..sequence import Sequence
from .profile import SimProfile

_MOD = (1 << 61) - 1
_MUL = 1_000_003
BYTE_VOCAB = 258  # the byte-level tokenizer's (tokenizer.ByteTokenizer): ids < 256 are bytes
MISSED_LOGPROB = -30.0


def printable_vocabulary(vocab_size: int, eos_ids: set[int]) -> list[int]:
    """The ids the sim generates: printable ASCII and newline for a byte vocabulary, else all but EOS."""
    if vocab_size <= BYTE_VOCAB:
        return [10, *range(32, 127)]
    return [i for i in range(vocab_size) if i not in eos_ids]


def step_shape(batch: list[Sequence]) -> tuple[list[tuple[int, int]], list[int]]:
    """A step's prefill chunks ``(new, cached)`` and decode rows' contexts (step 1 of the module docstring);
    what the profile's step time reads, and what a measurement of the real engine records."""
    chunks, contexts = [], []
    for seq in batch:
        if seq.num_tokens - seq.num_computed == 1 and seq.num_computed > 0:
            contexts.append(seq.num_computed + 1)
        else:
            chunks.append((seq.chunk_end - seq.num_computed, seq.num_computed))
    return chunks, contexts


class SimRunner:
    def __init__(self, profile: SimProfile, vocabulary: list[int], sleep: Callable[[float], None] = time.sleep):
        if not vocabulary:
            raise ValueError("the sim needs at least one token id to generate")
        self.profile, self.vocabulary, self.sleep = profile, vocabulary, sleep
        self._hashes: dict[str, tuple[int, int]] = {}  # request id -> (ids hashed, their rolling hash)
        self.modelled_s = 0.0  # the steps' modelled seconds since start (a counter)

    def forward_sample(self, batch: list[Sequence], on_layer: Callable[[int], None] | None):
        """(tokens, logprobs, prompt logprobs), one each per sequence (``engine_core.py``'s contract)."""
        seconds = self.profile.step.step_s(*step_shape(batch))
        self.modelled_s += seconds
        if on_layer is None:
            self.sleep(seconds)
        else:
            layers = self.profile.model.num_layers
            for layer in range(layers):
                self.sleep(seconds / layers)
                on_layer(layer)
        tokens: list[int | None] = []
        logprobs: list[TokenLogprob | None] = []
        prompt_lps: list[list | None] = []
        for seq in batch:
            end = seq.chunk_end
            token = self.next_token(seq.request_id, seq.all_ids, end) if end >= seq.num_tokens else None
            tokens.append(token)
            logprobs.append(self._logprob(token, seq.sampling.logprobs) if token is not None else None)
            prompt_lps.append(self._prompt_logprobs(seq, end))
        self._hashes = {seq.request_id: self._hashes[seq.request_id] for seq in batch
                        if seq.request_id in self._hashes}
        return tokens, logprobs, prompt_lps

    def next_token(self, request_id: str, ids: list[int], n: int) -> int:
        """The token after ``ids[:n]``: a rolling hash of them, kept per request so a step hashes only
        the ids added since the request's last step."""
        done, h = self._hashes.get(request_id, (0, 0))
        if done > n:
            done, h = 0, 0
        for t in ids[done:n]:
            h = (h * _MUL + t + 1) % _MOD
        self._hashes[request_id] = (n, h)
        mixed = (h ^ (h >> 29)) * 0x9E3779B97F4A7C15 % _MOD
        return self.vocabulary[mixed % len(self.vocabulary)]

    def _logprob(self, token: int, k: int | None) -> TokenLogprob | None:
        if k is None:
            return None
        others = [t for t in self.vocabulary[:k + 1] if t != token][:k]
        return TokenLogprob(token, 0.0, tuple([(token, 0.0)] + [(t, MISSED_LOGPROB) for t in others])[:k])

    def _prompt_logprobs(self, seq: Sequence, end: int) -> list | None:
        """This span's prompt logprobs (``model_runner``'s shape: None first for the first prompt token)."""
        k = seq.sampling.prompt_logprobs
        if k is None or not seq.needs_prompt_logits:
            return None
        start = seq.num_computed  # position p predicts prompt token p + 1
        head = [None] if start == 0 else []
        stop = min(len(seq.prompt_ids) - 1, end)
        return head + [TokenLogprob(seq.prompt_ids[p + 1], 0.0) for p in range(start, stop)]
