"""Request groups (QLM Algorithm 1): waiting requests alike in class and length move together.

QLM clusters the queue (k-means over model, token lengths and SLO) and splits any group
larger than ``avg_batch_size * delta`` in half; the global scheduler then orders groups, not
requests, which keeps its problem small. Here there is one model per front door, so a
group's key is exact instead of a cluster: ``(class, length bucket)``, the bucket being
``floor(log2(prompt tokens + expected output tokens))`` (requests within a factor of two of
each other's work). Members keep their arrival order; groups larger than ``max_size`` are
split in halves (earlier arrivals in the first half) until none is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from .classes import SloClass
from .estimator import Job


@dataclass(eq=False, slots=True)
class Waiting:
    """One request in a queue: what ordering needs to know about it."""

    request_id: str
    cls: SloClass
    arrival: float  # clock seconds
    seq: int        # arrival order (ties)
    job: Job


def length_bucket(tokens: float) -> int:
    return int(math.log2(max(1.0, tokens)))


@dataclass(eq=False, slots=True)
class Group:
    cls: SloClass
    bucket: int
    members: list[Waiting] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.members)


def make_groups(waiting: list[Waiting], expected_output: Callable[[Job], float], max_size: int) -> list[Group]:
    """Group ``waiting`` by (class, length bucket), in order of each group's first arrival."""
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    by_key: dict[tuple[str, int], Group] = {}
    for w in sorted(waiting, key=lambda w: w.seq):
        bucket = length_bucket(w.job.prompt_tokens + expected_output(w.job))
        key = (w.cls.name, bucket)
        if key not in by_key:
            by_key[key] = Group(w.cls, bucket)
        by_key[key].members.append(w)
    out: list[Group] = []
    for group in by_key.values():
        pending = [group]
        while pending:  # Algorithm 1, lines 2-6: split what is too large in half
            g = pending.pop(0)
            if len(g) <= max_size:
                out.append(g)
                continue
            half = (len(g) + 1) // 2
            pending[:0] = [Group(g.cls, g.bucket, g.members[:half]), Group(g.cls, g.bucket, g.members[half:])]
    return out
