"""TD-Pipe's decisions as pure logic (no torch, no processes), unit-tested on simulated traces.

1. Prefill -> decode, ``FutureMemory`` (the paper's Algorithm 1, "AI-based greedy prefill"):
   the KV blocks that every admitted request will hold at a few future decode steps
   (``points``: 0, 32, 64, ... steps from now, plus every member's last step, where the
   peaks are), each request growing by one token a step until its predicted output length,
   then freeing everything. A prompt is admitted while its
   contribution keeps every point within the capacity; the first prompt that does not fit
   ends the prefill phase. The prediction here is the request's ``max_tokens`` (exact for
   ignore-EOS offline sets; the paper trains a BERT classifier for open-ended outputs).
2. Decode -> prefill, ``should_prefill`` (spatial-temporal intensity comparison): spatial
   intensity = achieved decode throughput at the current batch size / the peak (at a large
   batch); temporal intensity = 1 - bubble / total of the prefill phase a switch would start
   (bubble: (stages - 1) x how much the longest prefill micro-batch outlasts a decode one;
   total: those prefills + one decode step per batch + the bubble). Switch when spatial < temporal.
3. Decode micro-batches, ``WorkStealer`` (inter-batch work stealing): a sliding window of the
   last ``num_batches`` submitted sizes (plus the pool, less what just finished) gives the
   average a returning batch should have; a larger batch leaves its extra requests in a
   pool, a smaller one takes from it. When fewer than ``num_batches x min_batch`` requests
   are live (the tail of a decode phase), a returning batch dissolves into the pool and one
   batch fewer cycles: on a machine where each micro-batch's round trip has a large fixed
   cost (processes woken over TCP on 2 shared cores), two batches of 2 cost twice one of 4.

``LinearCost`` fits stage seconds = a + b * x online (x: decode batch size or prefill tokens)
from the times the stages report, so the intensity comparison needs no offline profile.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Iterable, Sequence

from pdserve.engine.block_manager import blocks_needed


def future_points(horizon: int, step: int = 32) -> tuple[int, ...]:
    """Decode steps checked by the simulation: 0 (now), step, 2*step, ... up to >= horizon."""
    if step <= 0:
        raise ValueError(f"step must be positive, got {step}")
    return tuple(range(0, max(horizon, 0) + step, step))


class FutureMemory:
    """Simulated KV blocks in use at future decode steps, if nothing else is admitted.

    Checked at ``points`` (the paper's futurePoints: 0, 32, 64, ...) and, so that no peak
    falls between two points, at every member's last step: a request's blocks only grow
    until its last step and are freed after it, so the total is highest at some member's
    last step (or now). Each add is O(points + members).
    """

    def __init__(self, capacity_blocks: int, block_size: int, points: tuple[int, ...] = (0,)):
        self.capacity_blocks, self.block_size = capacity_blocks, block_size
        self.members: list[tuple[int, int]] = []  # (kv_tokens, remaining steps)
        self.usage: dict[int, int] = {p: 0 for p in set(points) | {0}}

    def _blocks(self, kv_tokens: int, remaining: int, step: int) -> int:
        return blocks_needed(kv_tokens + step, self.block_size) if step <= remaining else 0

    def contribution(self, kv_tokens: int, remaining: int) -> list[int]:
        """Blocks one request would hold at each point (sorted): it has ``kv_tokens`` tokens of
        KV and runs ``remaining`` more decode steps (one token of KV each), then frees all."""
        return [self._blocks(kv_tokens, remaining, p) for p in sorted(self.usage)]

    def _usage_at(self, step: int) -> int:
        if step in self.usage:
            return self.usage[step]
        return sum(self._blocks(kv, r, step) for kv, r in self.members)

    def add(self, kv_tokens: int, remaining: int) -> None:
        if remaining not in self.usage:
            self.usage[remaining] = self._usage_at(remaining)
        for p in self.usage:
            self.usage[p] += self._blocks(kv_tokens, remaining, p)
        self.members.append((kv_tokens, remaining))

    def fits(self, kv_tokens: int, remaining: int) -> bool:
        """Would every point (and this request's own last step) stay within the capacity?"""
        cap = self.capacity_blocks
        if self._usage_at(remaining) + self._blocks(kv_tokens, remaining, remaining) > cap:
            return False
        return all(u + self._blocks(kv_tokens, remaining, p) <= cap for p, u in self.usage.items())

    def peak(self) -> int:
        return max(self.usage.values())


def admit_prompts(memory: FutureMemory, prompts: Iterable[tuple[int, int]]) -> int:
    """Greedy prefill: how many of ``prompts`` ((prompt_tokens, predicted_output_tokens), FIFO)
    to admit; admitted ones are added to ``memory``. Stops at the first that does not fit."""
    n = 0
    for prompt_tokens, output_tokens in prompts:
        remaining = max(output_tokens - 1, 0)  # the prefill samples the first output token
        if not memory.fits(prompt_tokens, remaining):
            break
        memory.add(prompt_tokens, remaining)
        n += 1
    return n


class LinearCost:
    """Seconds = a + b * x, least squares over the last ``window`` samples; ``prior`` until
    two distinct x have been seen."""

    def __init__(self, prior: tuple[float, float], window: int = 64):
        self.prior = prior
        self.samples: deque[tuple[float, float]] = deque(maxlen=window)

    def observe(self, x: float, seconds: float) -> None:
        self.samples.append((float(x), float(seconds)))

    def coefficients(self) -> tuple[float, float]:
        xs = [x for x, _ in self.samples]
        if len(set(xs)) < 2:
            if self.samples:  # one size seen: keep the prior's slope, fit the intercept
                x, y = self.samples[-1]
                b = self.prior[1]
                return max(y - b * x, 0.0), b
            return self.prior
        n = len(xs)
        mx = sum(xs) / n
        my = sum(y for _, y in self.samples) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in self.samples) / sxx
        b = max(b, 1e-9)
        return max(my - b * mx, 0.0), b

    def __call__(self, x: float) -> float:
        a, b = self.coefficients()
        return a + b * x


def spatial_intensity(batch_size: int, decode_cost: LinearCost, peak_batch: int) -> float:
    """Decode throughput (requests per second per micro-batch) at ``batch_size`` over that at
    ``peak_batch``, capped at 1."""
    if batch_size <= 0:
        return 0.0
    achieved = batch_size / decode_cost(batch_size)
    peak = peak_batch / decode_cost(peak_batch)
    return min(achieved / peak, 1.0)


def prefill_microbatches(prompt_tokens: Sequence[int], token_budget: int) -> list[int]:
    """Token counts of the prefill micro-batches FIFO packing of ``prompt_tokens`` gives
    (a prompt longer than the budget gets a micro-batch of its own)."""
    batches, cur = [], 0
    for n in prompt_tokens:
        if cur and cur + n > token_budget:
            batches.append(cur)
            cur = 0
        cur += n
    if cur:
        batches.append(cur)
    return batches


def temporal_intensity(prefill_batches: Sequence[int], decode_batch_size: int, num_stages: int,
                       prefill_cost: LinearCost, decode_cost: LinearCost) -> float:
    """1 - bubble / total of the prefill phase a switch now would start (0 when nothing to prefill)."""
    if not prefill_batches:
        return 0.0
    times = [prefill_cost(t) for t in prefill_batches]
    t_decode = decode_cost(decode_batch_size) if decode_batch_size > 0 else 0.0
    bubble = (num_stages - 1) * max(max(times) - t_decode, 0.0)
    total = sum(times) + num_stages * t_decode + bubble
    return 1.0 - bubble / total if total > 0 else 0.0


def should_prefill(spatial: float, temporal: float) -> bool:
    """The paper's rule: leave the decode phase when its efficiency fell below what a prefill
    phase would achieve net of its switching bubble."""
    return spatial < temporal


class WorkStealer:
    """Sliding-window balance of ``num_batches`` decode micro-batches (see the module docstring)."""

    def __init__(self, num_batches: int, min_batch: int = 1):
        if num_batches <= 0:
            raise ValueError(f"num_batches must be positive, got {num_batches}")
        if min_batch <= 0:
            raise ValueError(f"min_batch must be positive, got {min_batch}")
        self.max_batches = self.num_batches = num_batches
        self.min_batch = min_batch  # fewer live requests than num_batches x this: one batch fewer
        self.window: deque[int] = deque(maxlen=num_batches)
        self.pool: list = []  # requests held back, given to the next smaller batch
        self.enabled = True

    def start(self, batches: list[list], in_flight: int = 0) -> None:
        """A new decode phase: ``batches`` are submitted as they are; with the ``in_flight`` decode
        batches of the last phase, they are the batches that cycle from now on."""
        self.num_batches = max(min(len(batches) + in_flight, self.max_batches), 1)
        self.window = deque((len(b) for b in batches), maxlen=self.num_batches)
        # the pool is kept (the same list object: the engine may share it as its ready set)

    def rebalance(self, remaining: list, num_finished: int) -> list:
        """The batch to resubmit, from a returning batch's unfinished requests ``remaining``
        (``num_finished`` of it just finished)."""
        if not self.enabled:
            self.window.append(len(remaining))
            return remaining
        # live requests: the window's submitted sizes, less the ones that just finished, plus
        # those held back (or arrived late: a prefill that returned after the switch)
        live = sum(self.window) - num_finished + len(self.pool)
        if self.num_batches > 1 and live < self.num_batches * self.min_batch:
            # too few requests for this many batches: this one dissolves into the pool, the next
            # returning batch takes them (a batch's fixed cost per round trip is paid once less)
            self.num_batches -= 1
            self.pool.extend(remaining)
            self.window = deque(list(self.window)[1:], maxlen=self.num_batches)
            return []
        avg = max(live / self.num_batches, 0.0)
        target = max(int(math.ceil(avg - 1e-9)), 1)
        out = list(remaining)
        if len(out) > target:
            self.pool.extend(out[target:])
            out = out[:target]
        elif len(out) < target and self.pool:
            take = min(target - len(out), len(self.pool))
            out += self.pool[:take]
            del self.pool[:take]
        self.window.append(len(out))
        return out

    def drain(self) -> list:
        """Requests still held in the pool (the phase ends: they go back to the ready set)."""
        out = list(self.pool)
        self.pool.clear()
        return out
