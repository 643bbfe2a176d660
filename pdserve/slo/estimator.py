"""The request waiting-time estimator (QLM, Algorithm 1's companion: equations 1-4), learned online.

A request's completion time is its wait, its prefill and its decode (QLM eq. 1)::

    C_q = W_q + P_q + D_q

- ``P_q``: prefill time of its prompt, a line ``a + b * tokens`` fitted online to what
  requests took from admission (a decode allocated) to their first token, ``tokens`` being the
  prompt tokens the prefill computes: the prompt less the leading tokens its prefix cache held
  at arrival (``Job.cached_tokens``; a later turn of a conversation costs its new tokens, not
  its whole prompt, so the fit is not skewed by hits and a hit is not taken for a long wait);
- ``D_q = (O_q - 1) * d`` (eq. 4; the first token comes with the prefill): ``O_q`` its
  expected output length, ``E[min(O, max_tokens)]`` over the recent output lengths of its
  class (learned online, one window per class), and ``d`` the measured time per output
  token at the current load (QLM's ``epsilon * d``: we measure the loaded per-token time
  directly, from the gaps between the tokens of the running requests, so the slowdown
  factor is 1);
- ``W_q`` (eq. 2): QLM divides the output tokens queued ahead by the throughput,
  ``sum O_i / Theta``. We use the same quantities one step less fluid (``simulate``): the
  backend serves several requests at once (``Theta = K / d``); the running requests free
  what they hold after their expected remaining tokens, and the requests ahead start, in
  order, as soon as what they need is free, each for ``P_i + D_i``. For many requests
  ahead this is eq. 2; for few it does not pretend a half-finished batch drains as one.
  What bounds concurrency in pdserve is the decodes' KV memory (a decode reserves prompt +
  max_tokens blocks): given the decodes' total KV blocks, the plan counts blocks
  (``by_blocks``); without it, ``K`` slots, K being the concurrency observed whenever a
  request had to wait for the decodes (the backend was full). Where the line also waits for
  the prefill's compute (its slots gate it), a request starts only when the prefill's one
  engine is free as well: the prompts it has taken on first, then one after another.

The spread of the wait (eq. 3: the sum of q - 1 output lengths is about normal with variance
``(q - 1) * sigma_o^2``) is reported as ``Estimate.wait_sd``.

Every number comes from observations the front door makes anyway (``observe_*``); before the
first ones, ``warm`` is False and nothing is rejected on an estimate.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .measures import OUTPUT_WINDOW, Ewma, LineFit, OutputLengths, WindowRate

__all__ = ["Estimate", "Estimator", "Job", "simulate"]


@dataclass(frozen=True, slots=True)
class Job:
    """What the plan needs of one request: its class (output lengths), prompt and token limit,
    the KV blocks a decode reserves for it (prompt + max_tokens), and the leading prompt tokens
    the prefill's prefix cache held when it arrived (not computed again)."""

    cls: str
    prompt_tokens: int
    max_tokens: int
    blocks: int = 1
    cached_tokens: int = 0

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens the prefill computes (at least the last one, whose logits give the first token)."""
        return max(1, self.prompt_tokens - self.cached_tokens)


@dataclass(frozen=True, slots=True)
class Estimate:
    wait: float      # W: seconds until it leaves the queue (a slot is free)
    prefill: float   # P
    decode: float    # D = O * d
    output_tokens: float
    wait_sd: float = 0.0

    @property
    def first_token(self) -> float:
        return self.wait + self.prefill

    @property
    def total(self) -> float:
        return self.wait + self.prefill + self.decode


class Estimator:
    """Measured throughput -> estimates. Not thread-safe (one event loop owns it)."""

    def __init__(self, window: int = OUTPUT_WINDOW):
        self.lengths = OutputLengths(window)
        self.prefill_fit = LineFit()
        self.per_token = WindowRate()  # d: seconds per output token at the current load
        self.slots = Ewma(alpha=0.3)  # K: requests served at once when the backend was full
        self.lag = Ewma(alpha=0.2)  # seconds from room freed to the next waiting request admitted

    # -- observations ----------------------------------------------------------------------
    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Admission (a decode allocated) -> first token, for a prompt of which ``tokens`` were computed."""
        if seconds >= 0:
            self.prefill_fit.add(tokens, seconds)

    def observe_gap(self, now: float, tokens: int, seconds: float) -> None:
        """A running request's next ``tokens`` tokens came ``seconds`` after its previous ones: the
        per-token time as it is now (the batch slows down as it grows)."""
        if tokens > 0 and seconds >= 0:
            self.per_token.add(now, tokens, seconds)

    def observe_lag(self, seconds: float) -> None:
        """Room was freed (a request ended) and the next waiting request was admitted ``seconds``
        later (load reports, retries): every start after a wait costs that much."""
        if seconds >= 0:
            self.lag.add(seconds)

    def observe_output(self, cls: str, tokens: int, hit_limit: bool = False) -> None:
        """A request of ``cls`` finished with ``tokens`` tokens (``hit_limit``: it made max_tokens)."""
        self.lengths.add(cls, tokens, hit_limit)

    def observe_full(self, running: int) -> None:
        """A request had to wait while ``running`` requests were being served: the backend's K."""
        if running > 0:
            self.slots.add(running)

    @property
    def warm(self) -> bool:
        return self.per_token.value is not None and self.prefill_fit.n > 0

    # -- estimates -------------------------------------------------------------------------
    def prefill_time(self, tokens: int) -> float:
        """Seconds to compute ``tokens`` prompt tokens (0 before the first observation)."""
        p = self.prefill_fit.predict(tokens)
        return 0.0 if p is None else p

    def output_tokens(self, job: Job, produced: int = 0) -> float:
        return self.lengths.expected(job.cls, job.max_tokens, produced)

    def service(self, job: Job) -> tuple[float, float, float]:
        """(P, D, O) of a job about to start."""
        out = self.output_tokens(job)
        return self.prefill_time(job.computed_tokens), max(0.0, out - 1) * (self.per_token.value or 0.0), out

    def remaining(self, job: Job, produced: int) -> float:
        """Seconds until a running request that has produced ``produced`` tokens frees its slot."""
        return self.output_tokens(job, produced) * (self.per_token.value or 0.0)

    def capacity(self, running: int, queue_nonempty: bool) -> int | None:
        """K for a plan: when requests already wait, the backend is full as it is now; else what
        was observed full before (None: never seen full, every new request starts at once)."""
        if queue_nonempty:
            return max(1, running)
        if self.slots.value is None:
            return None
        return max(1, round(self.slots.value), running)

    def plan(self, frees_in: Sequence[float], jobs: list[Job], capacity: int | None,
             held: Sequence[int] | None = None, by_blocks: bool = False,
             engine: Sequence[float] | None = None) -> list[Estimate]:
        """Estimates of ``jobs`` served in this order: ``frees_in`` are the seconds until each
        running request frees what it holds (``held``: KV blocks with ``by_blocks``, else one
        of K slots), ``capacity`` the backend's KV blocks or K (None: unbounded); ``engine``
        (where the line also waits for the prefill's compute): the seconds until each prompt
        the prefill's one engine has taken on is computed (``simulate``)."""
        services = [self.service(job) for job in jobs]
        needs = [job.blocks for job in jobs] if by_blocks else None
        starts = simulate(frees_in, [p + d for p, d, _ in services], capacity, held, needs, self.lag.value or 0.0,
                          engine, [p for p, _, _ in services])
        d = self.per_token.value or 0.0
        k = max(1.0, (capacity or 1) / (sum(needs) / len(needs)) if needs else (capacity or 1))
        out, ahead_var = [], 0.0
        for job, start, (p, dec, o) in zip(jobs, starts, services):
            out.append(Estimate(start, p, dec, o, math.sqrt(ahead_var) * d / k))
            ahead_var += self.lengths.spread(job.cls, job.max_tokens) ** 2
        return out

    def snapshot(self) -> dict:
        return {"per_token_s": self.per_token.value, "slots": self.slots.value, "lag_s": self.lag.value,
                "warm": self.warm,
                "prefill_s_at_128": self.prefill_time(128), "output_samples": self.lengths.count()}


def simulate(frees_in: Sequence[float], durations: Sequence[float], capacity: int | None,
             held: Sequence[int] | None = None, needs: Sequence[int] | None = None, lag: float = 0.0,
             engine: Sequence[float] | None = None, prefills: Sequence[float] | None = None) -> list[float]:
    """Start times (seconds from now) of requests served strictly in this order by a backend of
    ``capacity`` units (slots, or KV blocks) whose running requests hold ``held`` units each
    (default 1) until ``frees_in``; each request needs ``needs`` units (default 1) for its
    duration and starts when they are free (never before the one ahead of it), ``lag``
    seconds after they were freed if it had to wait for them. None: no limit.

    ``engine`` (None: not a limit): the line also waits for the prefill's one engine, busy
    until the last of ``engine`` (the prompts it has taken on); a request starts only when
    the engine is free as well, and holds it for its ``prefills`` seconds (one prompt after
    another). A request thus starts at the later of the two: the decodes' room and the
    prefill's compute; what it holds of the decodes is held from then on."""
    n = len(durations)
    if capacity is None and engine is None:
        return [0.0] * n
    held = held if held is not None else [1] * len(frees_in)
    needs = needs if needs is not None else [1] * n
    prefills = prefills if prefills is not None else [0.0] * n
    heap = list(zip(frees_in, held))
    heapq.heapify(heap)
    used = sum(held)
    free = max(engine, default=0.0) if engine is not None else 0.0  # when the engine can take the next prompt
    t, starts = 0.0, []
    for duration, need, prefill in zip(durations, needs, prefills):
        if capacity is not None:
            need = min(need, capacity)
            while used + need > capacity and heap:
                free_at, units = heapq.heappop(heap)
                t, used = max(t, free_at + lag), used - units
        if engine is not None:
            t = max(t, free)
            free = t + prefill
        starts.append(t)
        if capacity is not None:
            used += need
            heapq.heappush(heap, (t + duration, need))
    return starts
