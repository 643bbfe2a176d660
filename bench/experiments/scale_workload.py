"""The scale experiment's workloads (issue 50 item 4): a trace whole, at its real lengths, its reuse bound, and a
compressed day generated from its statistics. Pure (no I/O but reading the trace), unit-tested without servers.

1. **whole trace** (``full_workload``): every request of the trace at its real prompt and output lengths and its
   arrival time divided by ``speedup`` (1: real time). A prompt is its hash ids' blocks (``TRACE_BLOCK_TOKENS``
   tokens each, the same tokens for the same id) and its own tokens past them; it is a ``BlockPrompt``: the
   blocks are shared ``bytes`` and the ids are made when the request is sent, so the 145M prompt tokens of
   Mooncake's conversation trace cost its ~100K distinct blocks of memory, not 145M Python ints. Token ids are
   1..255 (the byte vocabulary every sim server's tokenizer reads; the sim's time depends on lengths only).
2. **reuse bound** (``reuse_bound``): the fraction of prompt tokens a perfect prefix cache could serve: a
   request's leading hash ids whose whole prefix an earlier request already sent (block by trace block, the
   request's last token never served, as the engine's lookup), with one unlimited cache for every prefill
   (``one_cache``: the best any router can reach) and with round robin over ``n`` unlimited caches.
3. **a compressed day** (``daily_cycle``): conversations of the trace (``trace_workload.conversation_key``),
   drawn with replacement, start as a Poisson process whose rate follows a day squeezed into ``day_s``
   seconds: ``rate(t) = mean * (1 - a * cos(2 pi t / day_s))``, trough at 0 and ``day_s``, peak at the middle,
   ``a = (R - 1) / (R + 1)`` for a peak-to-trough ratio R; ``mean`` is the trace's own conversation rate times
   ``load``. Each drawn conversation keeps its turns' lengths and their offsets from its first turn, in real
   seconds or divided by ``turn_pace``: the trace's users wait a median 123 s between turns (5% under 30 s), so
   a day of a few minutes at their pace ends before most second turns, and the requests that reuse a prefix
   are the ones cut (a 240 s day keeps 14% of prompt tokens reusable against the trace's 37%); with
   ``turn_pace`` 10 the median wait is 12 s, still longer than a turn's answer on the H200 profile (about 4 s),
   and the day keeps the trace's reuse. Its ids shared with other conversations in the
   trace (the common system prompt) stay, its private ids get fresh ones per copy, so two copies share what
   two different users would, not each other's history. So the day keeps the trace's distributions of prompt
   and output lengths, turns per conversation and prefix reuse (what it draws is whole conversations), and
   changes only when they start. The peak-to-trough ratio is a choice, not a measurement (the trace is one hour
   of one service, with no day in it): 3 (``--peak-to-trough`` default), the middle of the 2-4x swing between
   the busiest and quietest hour of a regional interactive service. It sets what any planner can save over
   sizing for the peak: the mean rate is ``1 / (1 + a)`` of the peak's, 2/3 at R = 3 (a third saved at best),
   3/5 at R = 4, 3/4 at R = 2.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Iterator, Sequence

from pdserve.bench import trace_replay
from pdserve.bench.loadgen_workload import RequestSpec

from .trace_workload import conversation_key

BLOCK = trace_replay.TRACE_BLOCK_TOKENS
VOCAB_LOW, VOCAB_HIGH = 1, 255  # token ids of the prompts: the byte vocabulary's
_TO_VOCAB = bytes(VOCAB_LOW + b % (VOCAB_HIGH - VOCAB_LOW + 1) for b in range(256))  # a random byte -> a token id


class BlockPrompt(Sequence[int]):
    """A prompt's token ids as shared blocks (``bytes``) and its own tail: made into ints when iterated."""

    __slots__ = ("blocks", "tail", "n")

    def __init__(self, blocks: tuple[bytes, ...], tail: bytes, n: int):
        self.blocks, self.tail, self.n = blocks, tail, n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        left = self.n
        for part in (*self.blocks, self.tail):
            if left <= 0:
                return
            yield from part[:left]
            left -= len(part)

    def __getitem__(self, index):  # type: ignore[override]
        return list(self)[index]


def block_bytes(hash_id: int, seed: int) -> bytes:
    """The tokens of one trace block: the same for the same id and seed."""
    return random.Random(f"{seed}:block:{hash_id}").randbytes(BLOCK).translate(_TO_VOCAB)


def full_workload(reqs: list[trace_replay.TraceRequest], speedup: float = 1.0,
                  seed: int = 0) -> tuple[list[RequestSpec], list[float]]:
    """Every request at its real lengths, arrivals at ``time / speedup`` (module docstring, step 1)."""
    if not speedup > 0:
        raise ValueError(f"speedup must be > 0, got {speedup}")
    blocks: dict[int, bytes] = {}
    specs, arrivals = [], []
    t0 = reqs[0].time_s if reqs else 0.0
    for i, r in enumerate(reqs):
        n_in = r.input_length
        use = r.hash_ids[: -(-n_in // BLOCK)]
        for h in use:
            if h not in blocks:
                blocks[h] = block_bytes(h, seed)
        shared = tuple(blocks[h] for h in use)
        own = max(0, n_in - BLOCK * len(shared))
        tail = random.Random(f"{seed}:request:{i}").randbytes(own).translate(_TO_VOCAB)
        specs.append(RequestSpec(n_in, r.output_length, prompt_ids=BlockPrompt(shared, tail, n_in)))  # type: ignore[arg-type]
        arrivals.append((r.time_s - t0) / speedup)
    return specs, arrivals


def reuse_bound(reqs: list[trace_replay.TraceRequest], n_prefills: int = 1) -> dict:
    """Shares of prompt tokens a perfect prefix cache could serve (module docstring, step 2)."""
    if n_prefills < 1:
        raise ValueError(f"need >= 1 prefill, got {n_prefills}")
    one: set[int] = set()
    each: list[set[int]] = [set() for _ in range(n_prefills)]
    total = served_one = served_rr = 0
    for i, r in enumerate(reqs):
        chain = _chain(r.hash_ids[: -(-r.input_length // BLOCK)])
        mine = each[i % n_prefills]
        cap = r.input_length - 1  # the last prompt token is always computed
        served_one += min(cap, BLOCK * _leading(chain, one))
        served_rr += min(cap, BLOCK * _leading(chain, mine))
        total += r.input_length
        one.update(chain)
        mine.update(chain)
    return {"one_cache": served_one / total if total else 0.0,
            "round_robin": served_rr / total if total else 0.0, "prefills": n_prefills,
            "prompt_tokens": total, "block_tokens": BLOCK}


def unqueued_ttft(reqs: list[trace_replay.TraceRequest], prefill_s, n_prefills: int, one_cache: bool) -> list[float]:
    """Each request's TTFT with no queueing: ``prefill_s(new, cached)`` (a profile's ``StepTime.prefill_s``) of
    what a perfect prefix cache leaves to compute, with one cache for all (``one_cache``: the best router) or
    round robin's ``n_prefills`` caches; the floor no routing policy goes below, whatever the load."""
    served = served_by_one_cache(reqs, 1 if one_cache else n_prefills)
    return [prefill_s(r.input_length - s, s) for r, s in zip(reqs, served)]


def served_by_one_cache(reqs: list[trace_replay.TraceRequest], n_caches: int = 1) -> list[int]:
    """Each request's prompt tokens a perfect prefix cache holds when it arrives (its leading trace blocks an
    earlier request sent; never its last token): one unlimited cache, or ``n_caches`` taken in turn."""
    if n_caches < 1:
        raise ValueError(f"need >= 1 cache, got {n_caches}")
    caches: list[set[int]] = [set() for _ in range(n_caches)]
    out = []
    for i, r in enumerate(reqs):
        chain = _chain(r.hash_ids[: -(-r.input_length // BLOCK)])
        cache = caches[i % n_caches]
        out.append(max(0, min(r.input_length - 1, BLOCK * _leading(chain, cache))))
        cache.update(chain)
    return out


def _chain(ids: Sequence[int]) -> list[int]:
    """Each position's prefix as one hash (block i stands for ids[:i + 1])."""
    out, h = [], 0
    for x in ids:
        h = hash((h, x))
        out.append(h)
    return out


def _leading(chain: list[int], seen: set[int]) -> int:
    return next((k for k, h in enumerate(chain) if h not in seen), len(chain))


@dataclass(frozen=True, slots=True)
class DayCycle:
    """The compressed day's rate curve: conversation starts per second at ``t`` in [0, day_s]."""

    day_s: float
    mean_rate: float  # conversations per second, averaged over the day
    peak_to_trough: float

    def __post_init__(self) -> None:
        if not self.day_s > 0 or not self.mean_rate > 0 or not self.peak_to_trough >= 1:
            raise ValueError(f"a day needs day_s > 0, mean_rate > 0 and peak_to_trough >= 1, got {self}")

    @property
    def amplitude(self) -> float:
        return (self.peak_to_trough - 1) / (self.peak_to_trough + 1)

    def rate(self, t: float) -> float:
        return self.mean_rate * (1 - self.amplitude * math.cos(2 * math.pi * t / self.day_s))

    @property
    def peak_rate(self) -> float:
        return self.mean_rate * (1 + self.amplitude)


def conversations(reqs: list[trace_replay.TraceRequest]) -> list[list[trace_replay.TraceRequest]]:
    """The trace's requests grouped by conversation, each in arrival order, conversations by first arrival."""
    groups: dict[tuple, list[trace_replay.TraceRequest]] = {}
    for i, r in enumerate(reqs):
        groups.setdefault(conversation_key(r, i), []).append(r)
    return sorted(groups.values(), key=lambda g: g[0].time_s)


def daily_cycle(reqs: list[trace_replay.TraceRequest], day_s: float, peak_to_trough: float = 3.0,
                load: float = 1.0, seed: int = 0,
                turn_pace: float = 1.0) -> tuple[list[trace_replay.TraceRequest], DayCycle]:
    """A compressed day of the trace's conversations (module docstring, step 3): its requests and its curve; a
    conversation's turns keep their offsets from its first turn divided by ``turn_pace``."""
    if not load > 0 or not turn_pace > 0:
        raise ValueError(f"load and turn_pace must be > 0, got {load}, {turn_pace}")
    convs = conversations(reqs)
    span = max(r.time_s for r in reqs) - min(r.time_s for r in reqs)
    if len(convs) < 2 or span <= 0:
        raise ValueError("a daily cycle needs a trace of at least two conversations over some time")
    cycle = DayCycle(day_s, load * len(convs) / span, peak_to_trough)
    owners = Counter(h for c in convs for h in {h for r in c for h in r.hash_ids})
    next_id = 1 + max((h for c in convs for r in c for h in r.hash_ids), default=0)
    rng = random.Random(f"{seed}:day")
    out: list[trace_replay.TraceRequest] = []
    t = 0.0
    while True:  # thinning: candidates at the peak rate, each kept with probability rate(t) / peak
        t += rng.expovariate(cycle.peak_rate)
        if t >= day_s:
            break
        if rng.random() * cycle.peak_rate > cycle.rate(t):
            continue
        conv = convs[rng.randrange(len(convs))]
        fresh: dict[int, int] = {}
        for r in conv:
            ids = []
            for h in r.hash_ids:
                if owners[h] > 1:
                    ids.append(h)
                else:
                    if h not in fresh:
                        fresh[h], next_id = next_id, next_id + 1
                    ids.append(fresh[h])
            when = t + (r.time_s - conv[0].time_s) / turn_pace
            if when < day_s:
                out.append(trace_replay.TraceRequest(when, r.input_length, r.output_length, tuple(ids)))
    out.sort(key=lambda r: r.time_s)
    return out, cycle


def rate_by_bin(times: list[float], day_s: float, bins: int) -> list[float]:
    """Arrivals per second in ``bins`` equal parts of the day (the curve a report plots beside ``DayCycle``)."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    width = day_s / bins
    counts = [0] * bins
    for t in times:
        if 0 <= t < day_s:
            counts[min(bins - 1, int(t / width))] += 1
    return [c / width for c in counts]
