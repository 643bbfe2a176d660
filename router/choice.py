"""choose(): the prefill for one request, from prefix overlap and load. Pure and deterministic.

For each routable prefill (a ``Candidate``) the cost of sending the request there is

    cost = tokens it must compute (prompt - cached prefix) + load_weight * requests in flight

and the cheapest prefill whose free KV blocks hold what it must compute wins; ties go to
the prefill that rendezvous hashing ranks first for the prompt's first block, so one
conversation keeps landing on the same prefill and different ones spread. Nothing but the
arguments decides, so two routers with the same index and loads choose the same.

The reason (a metric label and a log field):
- ``single``  only one prefill was routable;
- ``prefix``  the chosen prefill holds the longest cached prefix of the prompt (> 0 blocks);
- ``load``    another prefill held a longer prefix, but its load outweighed it;
- ``balance`` no prefill held any of the prompt: chosen by load, then by hash.

``round_robin`` is the baseline the prefix experiment compares against (``--policy
round-robin``): the routable prefills in turn, blind to cache and load; reason ``round_robin``.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Candidate:
    address: str
    overlap_blocks: int  # leading prompt blocks the index says it holds
    in_flight: int  # requests it is serving
    kv_blocks_free: int
    block_size: int  # its KV block size in tokens

    @property
    def cached_tokens(self) -> int:
        return self.overlap_blocks * self.block_size


@dataclass(frozen=True, slots=True)
class Choice:
    address: str
    reason: str
    overlap_blocks: int
    ranking: tuple[str, ...]  # every candidate, best first (the next ones are for retries)


def rendezvous(prompt_key: int, address: str) -> int:
    h = hashlib.blake2b(struct.pack("<q", prompt_key) + address.encode(), digest_size=8)
    return struct.unpack("<Q", h.digest())[0]


def choose(candidates: list[Candidate], num_prompt_tokens: int, prompt_key: int, load_weight: float) -> Choice:
    """The best candidate and why; ValueError if there is none."""
    if not candidates:
        raise ValueError("no candidate prefill")

    def key(c: Candidate):
        to_compute = max(0, num_prompt_tokens - c.cached_tokens)
        fits = c.kv_blocks_free * c.block_size >= to_compute
        return (not fits, to_compute + load_weight * c.in_flight, rendezvous(prompt_key, c.address))

    ranked = sorted(candidates, key=key)
    best, longest = ranked[0], max(c.cached_tokens for c in candidates)
    if len(candidates) == 1:
        reason = "single"
    elif longest == 0:
        reason = "balance"
    elif best.cached_tokens == longest:
        reason = "prefix"
    else:
        reason = "load"
    return Choice(best.address, reason, best.overlap_blocks, tuple(c.address for c in ranked))


def round_robin(candidates: list[Candidate], turn: int) -> Choice:
    """The ``turn``-th candidate in address order (then the rest, for retries); blind to cache and load."""
    if not candidates:
        raise ValueError("no candidate prefill")
    ordered = sorted(candidates, key=lambda c: c.address)
    i = turn % len(ordered)
    ranked = ordered[i:] + ordered[:i]
    return Choice(ranked[0].address, "round_robin", ranked[0].overlap_blocks, tuple(c.address for c in ranked))
