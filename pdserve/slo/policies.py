"""Ordering policies of the global queue: which waiting request goes next.

- ``fifo``: arrival order (what a plain queue does).
- ``edf``: earliest deadline first; a request's deadline is its arrival plus its class's
  first target (TTFT, else end to end); classes without targets go last, FIFO among
  themselves. Uses no estimate.
- ``qlm``: QLM's global scheduler. The waiting requests form request groups (``groups.py``);
  the groups are ordered to minimise the number of requests that miss their SLO, measured
  with the waiting-time estimator: each request's latest start (the latest time it can leave
  the queue and still meet every target of its class, from its estimated prefill and
  decode time) and a simulation of the backend (``estimator.simulate``: K slots, or KV
  blocks). QLM
  solves this as an ILP (its eq. 6-13); we use a greedy after Moore-Hodgson (exact for one
  server and the count of late jobs):

  1. requests late even if served first cannot be saved: they go to the tail;
  2. the others form groups, ordered by their tightest latest start (EDF on groups); while
     some request would be late, one group from that point or before it goes to the tail:
     one that would still be on time at the back (a batch group with an hour to spare) if
     there is one, else the one that frees the most time per request it gives up;
  3. the tail (EDF within) goes in at the earliest group boundary where it makes nobody
     else late (before best-effort work and patient batch groups): late, but as little as
     that allows;
  4. with several slots the greedy is not exact: if plain EDF on latest starts misses fewer
     (or as many, less late), that order wins.

  At most about 2 simulations per group, O(groups * n log K) per decision; the cost is
  measured by ``pdserve.bench.slo_policy_cost`` and exported as ``pdserve_slo_policy_seconds``.

The orderings see a snapshot: ``Context`` (now, the estimator, when the running requests
free what they hold, the capacity). They are pure: same input, same order. The backend is the
decodes' KV blocks (or K slots), each request holding its share for P + D; where the line also
waits for a prefill's compute (``engine``: the prefill's slots gate it), a request starts only
when that one engine is free too, and holds it for its P, the prompts it is computing now ahead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .estimator import Estimate, Estimator, Job, simulate
from .groups import Group, Waiting, make_groups

POLICIES = ("fifo", "edf", "qlm")
GROUP_SIZE_FACTOR = 1.0  # QLM's delta: groups hold at most K * delta requests
_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class Context:
    now: float
    estimator: Estimator
    frees_in: tuple[float, ...] = ()  # seconds until each running request frees what it holds
    slots: int | None = None          # capacity: K slots, or KV blocks with by_blocks (None: unbounded)
    held: tuple[int, ...] | None = None  # by_blocks: the KV blocks each running request holds
    by_blocks: bool = False
    engine: tuple[float, ...] | None = None  # the line waits for the prefill's compute too: its prompts' ends

    def needs(self, ws: list[Waiting]) -> list[int] | None:
        return [w.job.blocks for w in ws] if self.by_blocks else None

    def starts(self, ws: list[Waiting], services: list[tuple[float, float]]) -> list[float]:
        """When each of ``ws`` would start if served in this order, each taking (P, D)."""
        return simulate(self.frees_in, [p + d for p, d in services], self.slots, self.held, self.needs(ws),
                        self.estimator.lag.value or 0.0, self.engine, [p for p, _ in services])

    def plan(self, jobs: list[Job]) -> list[Estimate]:
        """The estimator's estimates of ``jobs`` served in this order on this backend."""
        return self.estimator.plan(self.frees_in, jobs, self.slots, self.held, self.by_blocks, self.engine)

    def share(self, prefill: float, decode: float, k: float) -> float:
        """Seconds of the bottleneck a request takes: its 1/k of the decodes for P + D, or (where
        the line waits for the prefill's compute) the engine for P if that is more."""
        served = (prefill + decode) / k
        return served if self.engine is None else max(prefill, served)

    def drained(self, services: list[tuple[float, float]], k: float) -> float:
        """About when requests taking these (P, D) would all be served, ``k`` at a time (and one
        prompt at a time on the prefill's engine, where the line waits for it)."""
        served = sum(p + d for p, d in services) / k
        if self.engine is None:
            return served
        return max(served, max(self.engine, default=0.0) + sum(p for p, _ in services))

    def concurrency(self, ws: list[Waiting]) -> float:
        """About how many of ``ws`` the backend serves at once (K)."""
        if self.slots is None:
            return float(max(1, len(ws)))
        if not self.by_blocks or not ws:
            return float(self.slots)
        return max(1.0, self.slots / (sum(w.job.blocks for w in ws) / len(ws)))


def order(policy: str, waiting: list[Waiting], ctx: Context) -> list[Waiting]:
    if policy == "fifo":
        return sorted(waiting, key=lambda w: w.seq)
    if policy == "edf":
        return sorted(waiting, key=lambda w: (w.cls.deadline(w.arrival), w.seq))
    if policy == "qlm":
        return qlm(waiting, ctx)
    raise ValueError(f"unknown queue policy {policy!r}; known: {', '.join(POLICIES)}")


def latest_start(w: Waiting, prefill: float, decode: float, now: float) -> float:
    """Seconds from now by which ``w`` must leave the queue to meet every target (inf: none)."""
    c, limit = w.cls, math.inf
    if c.ttft_ms is not None:
        limit = min(limit, w.arrival + c.ttft_ms / 1000.0 - prefill)
    if c.e2e_ms is not None:
        limit = min(limit, w.arrival + c.e2e_ms / 1000.0 - prefill - decode)
    return limit - now


def evaluate(ordered: list[Waiting], ctx: Context) -> tuple[int, float]:
    """(requests that would miss, their total lateness in seconds) if served in this order."""
    services = [ctx.estimator.service(w.job) for w in ordered]
    starts = ctx.starts(ordered, [(p, d) for p, d, _ in services])
    late, lateness = 0, 0.0
    for w, start, (p, d, _) in zip(ordered, starts, services):
        over = start - latest_start(w, p, d, ctx.now)
        if over > _EPS:
            late, lateness = late + 1, lateness + over
    return late, lateness


def qlm(waiting: list[Waiting], ctx: Context) -> list[Waiting]:
    if len(waiting) < 2:
        return list(waiting)
    est = ctx.estimator
    service = {id(w): est.service(w.job) for w in waiting}  # (P, D, O), once per decision
    taking = {k: (p, d) for k, (p, d, _) in service.items()}
    start_by = {id(w): latest_start(w, service[id(w)][0], service[id(w)][1], ctx.now) for w in waiting}

    def misses(flat: list[Waiting]) -> tuple[int, float, int | None]:
        """(late requests, their lateness, index of the first late one) in this order."""
        starts = ctx.starts(flat, [taking[id(w)] for w in flat])
        late, lateness, first = 0, 0.0, None
        for i, (w, s) in enumerate(zip(flat, starts)):
            over = s - start_by[id(w)]
            if over > _EPS:
                late, lateness = late + 1, lateness + over
                first = i if first is None else first
        return late, lateness, first

    # a request late even if it went first cannot be saved by any order: it joins the tail
    first_free = {id(w): ctx.starts([w], [(0.0, 0.0)])[0] for w in waiting}
    doomed = [w for w in waiting if start_by[id(w)] < first_free[id(w)] - _EPS]
    viable = [w for w in waiting if start_by[id(w)] >= first_free[id(w)] - _EPS]
    k = ctx.concurrency(waiting)
    at_once = 1.0 if ctx.engine is not None else k  # requests leaving the line together: one prompt at a time
    groups = make_groups(viable, est.output_tokens, max(1, round(at_once * GROUP_SIZE_FACTOR)))

    def tightest(g: Group) -> float:
        return min(start_by[id(w)] for w in g.members)

    def work(g: Group) -> float:
        return sum(ctx.share(*taking[id(w)], k) for w in g.members)

    def flat(gs: list[Group]) -> list[Waiting]:
        return [w for g in gs for w in g.members]

    # Moore-Hodgson on groups: EDF, and while someone is late, one group from there or before goes to the tail
    kept = sorted(groups, key=lambda g: (tightest(g), g.members[0].seq))
    moved: list[Group] = []
    for _ in range(len(groups)):
        order_now = flat(kept)
        _, _, late_at = misses(order_now)
        if late_at is None:
            break
        seen, late_group = 0, len(kept) - 1
        for j, g in enumerate(kept):  # the group holding order_now[late_at]
            seen += len(g)
            if seen > late_at:
                late_group = j
                break
        done = ctx.drained([taking[id(w)] for w in flat(kept + moved)], k)  # about when everything is served
        candidates = kept[: late_group + 1]
        patient = [g for g in candidates if tightest(g) >= done]  # on time even at the back
        pick = max(patient, key=work) if patient else max(candidates, key=lambda g: work(g) / len(g))
        kept.remove(pick)
        moved.append(pick)
    # the tail (moved groups, then the doomed; EDF within) goes as early as it can without
    # making anyone else late: before best-effort requests and patient batch work
    tail = sorted(flat(moved) + doomed, key=lambda w: (start_by[id(w)], w.seq))
    best = flat(kept) + tail
    best_late = misses(best)[:2]
    for i in range(len(kept)):
        candidate = flat(kept[:i]) + tail + flat(kept[i:])
        late = misses(candidate)[:2]
        if late[0] <= best_late[0]:
            best, best_late = candidate, late
            break
    # the greedy is exact for one slot; with several, EDF can still win: keep the better one
    edf = sorted(waiting, key=lambda w: (start_by[id(w)], w.seq))
    return edf if misses(edf)[:2] < best_late else best
