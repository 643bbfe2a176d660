"""The trace-routing experiment's workload: a real trace, thinned by conversation, scaled to this box,
and the prefix reuse it allows at best. Pure (no I/O but reading the trace), unit-tested without servers.

1. **sample** (``sample_conversations``): keep each conversation with probability ``fraction``,
   decided by a generator seeded with (seed, conversation), so the same conversations are kept in every
   run and every arm. A conversation is told by its prompts' first two block ids (``conversation_key``):
   Mooncake's conversation trace starts every prompt with the same block (id 0, a shared system prompt),
   and each later turn of a conversation repeats its first turn's leading blocks. Sampling whole
   conversations thins the rate and keeps what prefix routing feeds on (a turn follows its earlier
   turns); sampling requests would cut conversations apart.
2. **scale** (``build_workload``): ``trace_replay.replay_requests`` over the window, lengths times
   ``length_scale`` (a hash id becomes ``512 * length_scale`` tokens), prompts and outputs cut, and the
   time scale chosen so that the window's sampled requests arrive over ``duration_s`` seconds.
3. **ceiling** (``reuse_ceiling``): the share of prompt tokens in reusable KV blocks (the engine's rule,
   ``engine/block_manager.py``) whose whole prefix an earlier request of the replay already had, with
   unlimited caches and no timing: ``one_cache`` (every request sees every earlier one: the best any
   router can do with N prefills), and ``round_robin``
   (request i sees only the earlier requests i mod N). A router can save at most ``one_cache`` of the
   prompt tokens, round robin already saves about ``round_robin``; their gap bounds what prefix-aware
   routing can win on compute, whatever the box: ``computed_ratio_bound`` = (1 - one_cache) /
   (1 - round_robin), the fewest prompt tokens computed it can reach as a share of round robin's.

``TraceWorkload.describe()`` is the line every result names (sampling, window, time and length scale).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench import trace_replay
from pdserve.bench.loadgen_workload import RequestSpec
from pdserve.engine.block_manager import chained_hashes, reusable_hashes


@dataclass(frozen=True, slots=True)
class TraceWorkload:
    specs: list[RequestSpec]
    arrivals: list[float]  # seconds from the replay's start
    scaling: trace_replay.Scaling
    fraction: float  # of the conversations kept
    seed: int

    @property
    def prompt_tokens(self) -> int:
        return sum(s.prompt_tokens for s in self.specs)

    @property
    def max_prompt_tokens(self) -> int:
        return max(s.prompt_tokens for s in self.specs)

    @property
    def max_output_tokens(self) -> int:
        return max(s.output_tokens for s in self.specs)

    def describe(self) -> str:
        return (f"{len(self.specs)} requests: conversations sampled x{self.fraction:g} (seed {self.seed}); "
                f"{self.scaling.describe()}")


def conversation_key(req: trace_replay.TraceRequest, index: int) -> tuple:
    """The conversation a request belongs to: its first two block ids (one block or none: its own)."""
    return ("ids", *req.hash_ids[:2]) if len(req.hash_ids) >= 2 else ("request", index)


def sample_conversations(reqs: list[trace_replay.TraceRequest], fraction: float,
                         seed: int = 0) -> list[trace_replay.TraceRequest]:
    """The requests of the conversations kept (each with probability ``fraction``), in their order."""
    if not 0 < fraction <= 1:
        raise ValueError(f"sample fraction must be in (0, 1], got {fraction}")
    keep: dict[tuple, bool] = {}
    out = []
    for i, r in enumerate(reqs):
        key = conversation_key(r, i)
        if key not in keep:
            keep[key] = random.Random(f"{seed}:{key}").random() < fraction
        if keep[key]:
            out.append(r)
    return out


def build_workload(path: Path, fmt: str, *, fraction: float, duration_s: float, length_scale: float,
                   pool: list[int], start_s: float = 0.0, window_s: float | None = None,
                   max_requests: int | None = None, max_prompt_tokens: int | None = None,
                   max_output_tokens: int | None = None, seed: int = 0) -> TraceWorkload:
    """Read, sample, window and scale a trace so that its requests arrive over ``duration_s`` seconds."""
    if not duration_s > 0:
        raise ValueError(f"duration must be > 0 s, got {duration_s}")
    sampled = sample_conversations(trace_replay.read_trace(path, fmt), fraction, seed)
    if not sampled:
        raise ValueError(f"no conversation of {path} kept at sample fraction {fraction}")
    unscaled = trace_replay.Scaling(1.0, length_scale, start_s, window_s, max_requests, max_prompt_tokens,
                                    max_output_tokens)
    span = trace_replay.window(sampled, unscaled)[-1].time_s
    time_scale = duration_s / span if span > 0 else 1.0
    scaling = trace_replay.Scaling(time_scale, length_scale, start_s, window_s, max_requests, max_prompt_tokens,
                                   max_output_tokens)
    specs, arrivals = trace_replay.replay_requests(sampled, scaling, pool, seed)
    return TraceWorkload(specs, arrivals, scaling, fraction, seed)


def reuse_ceiling(specs: list[RequestSpec], n_prefills: int, block_size: int) -> dict:
    """Shares of prompt tokens an earlier request already held as a prefix (module docstring, step 3)."""
    if n_prefills < 1 or block_size < 1:
        raise ValueError(f"need >= 1 prefill and block size >= 1, got {n_prefills}, {block_size}")
    one: set[int] = set()
    each: list[set[int]] = [set() for _ in range(n_prefills)]
    total = hit_one = hit_rr = 0
    for i, spec in enumerate(specs):
        ids = list(spec.prompt_ids or ())
        lookup = reusable_hashes(ids, block_size)  # what a prefix-cache lookup may match (not the last token)
        mine = each[i % n_prefills]
        hit_one += block_size * _leading(lookup, one)
        hit_rr += block_size * _leading(lookup, mine)
        total += spec.prompt_tokens
        stored = chained_hashes(ids[: len(ids) // block_size * block_size], block_size)  # every full block
        one.update(stored)
        mine.update(stored)
    one_share, rr_share = (hit_one / total, hit_rr / total) if total else (0.0, 0.0)
    return {"one_cache": one_share, "round_robin": rr_share, "prefills": n_prefills, "block_size": block_size,
            "computed_ratio_bound": (1 - one_share) / (1 - rr_share) if rr_share < 1 else None}


def _leading(hashes: list[int], cache: set[int]) -> int:
    return next((k for k, h in enumerate(hashes) if h not in cache), len(hashes))
