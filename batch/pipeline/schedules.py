"""What the next micro-batch is: ``mixed`` (the baseline) and ``td-pipe``.

Both answer ``next_batch()`` whenever the pipeline has a free slot (up to ``config.depth``
micro-batches in flight: ``num_stages`` unless ``micro_batches`` says more) and hear
``returned(mb, alive, num_finished)`` for every micro-batch that comes back (its unfinished
sequences ``alive``).

What enters a micro-batch of prompts is never decided here: both schedules ask the engine's
one Scheduler (``engine.prompts``: ``pdserve.engine.scheduler.Scheduler.schedule_prompts``),
which gives prompts part-way their next chunk and admits waiting ones in the queue's order
(priority: the SLO queue's order; then arrival) while blocks, ``max_num_seqs`` and the token
budget allow, a long prompt in chunks. The schedules decide *when* prompts run and what
else shares the micro-batch.

``mixed`` (hybrid batching, as a pipeline-parallel vLLM runs it): each micro-batch is every
decode-ready sequence not in flight (in steady state: the batch that just came back) plus the
Scheduler's prompt work within what the decode rows leave of the step's token budget.
Prefills and decodes share micro-batches, so micro-batches differ in size with whatever
prompts happened to join them, and a decode must wait for its own previous step.

``td-pipe`` (temporally disaggregated): a *prefill phase* sends only prefill micro-batches
(no dependency between them, so every stage stays busy: a long prompt's chunks follow each
other), the Scheduler admitting prompts while the simulated decode of everything admitted
still fits in the KV blocks (``switch.FutureMemory``, its ``admits`` check); the first prompt
that does not fit starts the *decode phase*: the decode-ready sequences are
split into ``config.depth`` micro-batches that cycle through the pipeline, rebalanced by work
stealing every time one comes back (``switch.WorkStealer``; its pool is the engine's ``ready``
list, which is also where sequences whose prefill returns late arrive, so the lightest batches
absorb them). When a decode micro-batch comes back and prompts wait, the spatial-temporal
intensity comparison (``switch.should_prefill``) decides whether to start a prefill phase;
stage seconds per micro-batch (from the stages' own timings) feed its online cost fits.
"""

from __future__ import annotations

from . import protocol as P
from . import switch


def make_schedule(name: str, engine):
    if name == "mixed":
        return MixedSchedule(engine)
    if name == "td-pipe":
        return TDPipeSchedule(engine)
    raise ValueError(f"unknown schedule {name!r}")


class MixedSchedule:
    def __init__(self, engine):
        self.engine = engine
        self.phases: list[tuple[float, str]] = []

    def next_batch(self) -> list:
        eng = self.engine
        decodes, eng.ready = eng.ready, []
        decodes = eng.grow(decodes)
        prefills = eng.prompts(eng.config.max_num_batched_tokens - len(decodes))  # one budget for the step
        return prefills + decodes

    def returned(self, mb, alive: list, num_finished: int) -> None:
        self.engine.ready.extend(alive)

    def holds(self) -> bool:
        return False


class TDPipeSchedule:
    PRIOR_DECODE = (0.005, 0.0005)  # seconds per stage: fixed, per sequence (until measured)
    PRIOR_PREFILL = (0.005, 0.0001)  # fixed, per prompt token

    def __init__(self, engine):
        import time

        self.engine = engine
        self.clock = time.perf_counter
        n = engine.config.depth  # decode micro-batches that cycle through the pipeline
        self.stealer = switch.WorkStealer(n, engine.config.min_decode_batch)
        self.stealer.enabled = engine.config.work_stealing
        self.stealer.pool = engine.ready  # the same list: held-back requests are ready ones
        self.decode_cost = switch.LinearCost(self.PRIOR_DECODE)
        self.prefill_cost = switch.LinearCost(self.PRIOR_PREFILL)
        self.phase = "prefill"
        self.phases: list[tuple[float, str]] = [(self.clock(), "prefill")]
        self.memory: switch.FutureMemory | None = None
        self.queue: list[list] = []  # decode micro-batches to send next
        self.in_decode = 0  # decode micro-batches in flight
        self.last_check_running = -1
        self.peak_batch = max(engine.config.max_num_seqs // n, 1)

    # ---- the memory simulation -------------------------------------------------------------
    def _simulation(self) -> switch.FutureMemory:
        eng = self.engine
        running = eng.running_seqs()
        horizon = max([s.sampling.max_tokens for s in eng.waiting] +
                      [s.sampling.max_tokens - len(s.output_ids) for s in running] + [1])
        mem = switch.FutureMemory(eng.config.num_blocks, eng.config.block_size, switch.future_points(horizon, 32))
        for s in running:
            mem.add(s.num_tokens, max(s.sampling.max_tokens - len(s.output_ids), 0))
        return mem

    @staticmethod
    def _remaining(seq) -> int:
        """Decode steps left after its (re)prefill: the predicted output length is max_tokens."""
        return max(seq.sampling.max_tokens - len(seq.output_ids) - 1, 0)

    def _admits(self, seq) -> bool:
        """The Scheduler's last question on a prompt it is about to admit: does the simulated decode of
        everything admitted still fit with it? If so it is counted in (the Scheduler then admits it)."""
        if self.engine.num_running() and not self.memory.fits(seq.num_tokens, self._remaining(seq)):
            return False  # (none running: it fits, never stall; add_request checked the pool)
        self.memory.add(seq.num_tokens, self._remaining(seq))
        return True

    # ---- phases ----------------------------------------------------------------------------
    def _enter(self, phase: str) -> None:
        self.phase = phase
        self.phases.append((self.clock(), phase))
        if phase == "prefill":
            for batch in self.queue:  # formed, not sent: back to the ready set
                self.engine.ready.extend(batch)
            self.queue = []
            self.memory = self._simulation()
        else:
            self.memory = None
            n = self.engine.config.depth - self.in_decode
            ready = self.engine.ready
            if n > 0 and ready:
                n = max(min(n, len(ready) // self.engine.config.min_decode_batch), 1)
                size = -(-len(ready) // n)
                self.queue = [ready[i : i + size] for i in range(0, len(ready), size)]
                del ready[:]
                self.stealer.start(self.queue, self.in_decode)

    def next_batch(self) -> list:
        eng = self.engine
        if self.phase == "prefill":
            if self.memory is None:
                self.memory = self._simulation()
            batch = eng.prompts(admits=self._admits)
            if batch:
                return batch
            if eng.in_flight and eng.in_flight[-1].kind == P.KIND_PREFILL and not eng.ready:
                return []  # nothing to decode yet: wait for the prefills in flight
            self._enter("decode")
        while self.queue:
            batch = eng.grow(self.queue.pop(0))
            if batch:
                self.in_decode += 1
                return batch
        if eng.ready and self.in_decode < self.stealer.num_batches:
            # a free slot and held-back (or newly prefilled) requests: one more decode batch
            take = eng.ready[: max(self.peak_batch, 1)]
            del eng.ready[: len(take)]
            self.stealer.window.append(len(take))
            batch = eng.grow(take)
            if batch:
                self.in_decode += 1
                return batch
        if not eng.ready and not self.in_decode and not eng.in_flight and eng.waiting:
            self._enter("prefill")  # everything finished: back to prefill
            return self.next_batch()
        return []

    def holds(self) -> bool:
        """Decode micro-batches formed but not sent yet."""
        return any(self.queue)

    def returned(self, mb, alive: list, num_finished: int) -> None:
        eng = self.engine
        stage_s = max(mb.times) if mb.times else 0.0
        if mb.kind == P.KIND_PREFILL:
            self.prefill_cost.observe(mb.rows, stage_s)
            eng.ready.extend(alive)
            return
        self.in_decode -= 1
        self.decode_cost.observe(len(mb.seqs), stage_s)
        if self.phase != "decode":
            eng.ready.extend(alive)
            return
        if eng.waiting and self._switch_to_prefill(len(alive)):
            eng.ready.extend(alive)
            self._enter("prefill")
            return
        batch = self.stealer.rebalance(alive, num_finished)
        if batch:
            self.queue.append(batch)

    def _switch_to_prefill(self, batch_size: int) -> bool:
        eng = self.engine
        running = eng.num_running()
        if running == self.last_check_running:
            return False  # nothing finished since the last check: the answer is the same
        self.last_check_running = running
        n = eng.config.num_stages
        avg = running / eng.config.depth
        spatial = switch.spatial_intensity(max(int(avg), 1), self.decode_cost, self.peak_batch)
        if spatial >= 1.0:
            return False
        mem = self._simulation()
        budget = eng.config.max_num_seqs - running
        candidates = [(s.num_tokens, self._remaining(s) + 1) for s in list(eng.waiting)[:max(budget, 0)]]
        k = switch.admit_prompts(mem, candidates)
        batches = switch.prefill_microbatches([c[0] for c in candidates[:k]], eng.config.max_num_batched_tokens)
        temporal = switch.temporal_intensity(batches, max(int(avg), 1), n, self.prefill_cost, self.decode_cost)
        return switch.should_prefill(spatial, temporal)
