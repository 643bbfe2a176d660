"""Scheduler: where every request is (waiting, running, held, reserved) and what runs next.

Owns the request table and the queues; the BlockManager it is given does the block
accounting. Pure Python (no torch).

Places a request can be, by request id:
- ``waiting`` (a deque in admission order) then ``running`` (list): every prompt and decode.
- held: a remote prefill (the P/D prefill side) whose prompt is computed, in ``seqs`` but in
  neither queue, until released.
- ``reserved``: blocks taken by ``reserve`` on the decode side, before ``add_prefilled`` (or
  ``prefill_reserved``); ``reserved_prefix`` holds the token ids of a reservation's leading
  tokens whose KV came from the prefix cache (its first blocks are shared, cached ones).
- ``done_early``: finished outside a step (by its first token); the next step reports it.
- ``swapped``: running sequences evicted to host memory (``swap.py``): in ``seqs``, in no
  queue, no blocks, until ``swap_in``.

``schedule()`` for one step (prefill spans first, then decode rows):
1. every running sequence at a decode row gets a slot for its next token; when blocks run out, the
   newest colocated (not reserved, not remote) running sequence is preempted: its blocks are freed and it goes
   back to the head of ``waiting`` to be recomputed (``num_preemptions`` counts these);
2. prompts part-way (chunked prefill) get their next chunk, then waiting sequences are admitted
   in order (``priority``, then arrival: FIFO by default) while blocks, ``max_num_seqs`` and the
   step's token budget ``max_num_batched_tokens`` allow, each with its first chunk: a prompt longer
   than the budget takes several steps. At most ``max_partial_prefills`` (1) prompts are part-way
   at once (two long prompts run one after the other: interleaved, each would get its first
   token later). While a short prompt waits, a long prompt's chunk is at most
   ``long_prefill_threshold`` tokens (0: the whole budget), so the short one shares the step and
   passes it. Each sequence's ``num_new`` says how many tokens it computes in the step (a chunk
   before the prompt's last samples nothing).

``schedule_prompts(budget, admits)`` is step 2 alone (the prompt work of a step): the pipeline
engine (``batch/pipeline``), whose decode rows its own schedules form (micro-batches, TD-Pipe's
phases and work stealing), takes every prompt through it; ``admits(seq)``, asked last before a
prompt is admitted, is where TD-Pipe's KV-memory simulation says no (which ends its prefill phase).

Decode side with a TBT bound (``join_gate``, step_budget.py): a prefilled sequence waits in ``joining``
(its blocks held) until ``admit_joining``, at the start of each ``schedule``, finds it room.

Request kinds, all scheduled here: colocated (waiting -> running -> finished), the decode side's
``prefill_reserved`` (joins ``running`` with its blocks reserved: chunked, never preempted),
the P/D prefill side's remote prefill (``remote_prefill.py``: waiting -> running, chunked, its KV
pushed layer by layer as each chunk is written; once prefilled it is held, never preempted), and
the pipeline engine's prompts (chunked; a chunk is sent while the one before is in flight).
A remote prefill may wait in line for its grant (its decode's blocks, ``remote_prefill.py``): it keeps its
place, is never computed before it, and is asked for (``want``) when a step reaches it in line, when
``_limit`` finds it short enough to pass a long prompt, or when ``ask_ahead`` expects the next step to
admit it; the prompts behind it go on meanwhile.

Who frees: ``finish`` (a finished running sequence), ``remove`` (abort) and ``free_blocks``
drop a sequence's block references exactly once; a reservation is freed by ``remove`` or
handed over to its sequence by the caller.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from .block_manager import BlockManager
from .errors import OutOfBlocksError
from .sequence import Sequence, Status
from .step_budget import TbtBudget

Admits = Callable[[Sequence], bool]  # a caller's last word on a prompt about to be admitted (schedule_prefills)
SHORT_SCAN = 8  # waiting prompts looked at per step for a short one that may pass a long prompt


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill_threshold: int = 0, max_partial_prefills: int = 1, solo_prompt_tokens: int = 0):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # the most tokens of one prompt a step computes (0: the whole budget): the rest of the budget is left
        # for other prompts, so a short one never waits for a long one's whole prefill
        self.chunk_tokens = min(long_prefill_threshold or max_num_batched_tokens, max_num_batched_tokens)
        self.max_partial_prefills = max_partial_prefills  # prompts part-way at once (the rest wait their turn)
        # prompts share a step only up to this many prompt tokens (0: up to the budget): where a forward pass's time
        # grows with its tokens (one CPU core), a second prompt in the step delays the first one's first token by
        # its own compute, so there a prompt runs alone and a short one passes a long one by a step of its own
        self.solo_prompt_tokens = solo_prompt_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}  # waiting, running, or prefilled-and-held
        self.reserved: dict[str, list[int]] = {}  # decode side: request id -> block table
        self.reserved_prefix: dict[str, tuple[int, ...]] = {}  # request id -> the cached tokens it reused
        self.done_early: list[Sequence] = []  # finished outside step(); reported by the next step
        self.swapped: dict[str, Sequence] = {}  # evicted to host memory, the first evicted first
        self.num_preemptions = 0  # colocated sequences freed and recomputed for lack of blocks
        # decode side, with a TBT bound (step_budget.py): prefilled sequences whose KV is in, waiting for room in
        # the batch; ``join_gate`` says whether one more fits (None: every one joins at once)
        self.joining: deque[Sequence] = deque()
        self.join_gate: TbtBudget | None = None

    # ---- the request table -----------------------------------------------------------------
    def in_use(self, request_id: str) -> bool:
        return request_id in self.seqs or request_id in self.reserved

    def request_ids(self) -> list[str]:
        """Every request holding state: waiting, running, held, or reserved."""
        return list(self.seqs) + list(self.reserved)

    def num_requests(self) -> int:
        return len(self.seqs) + len(self.reserved)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.done_early or self.joining)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence in ``waiting``, in (``priority``, arrival) order: with equal priorities (the
        default) at the end."""
        self.seqs[seq.request_id] = seq
        at = len(self.waiting)
        while at > 0 and (self.waiting[at - 1].priority, self.waiting[at - 1].arrival) > (seq.priority, seq.arrival):
            at -= 1
        self.waiting.insert(at, seq)

    def hold_prefilled(self, seq: Sequence) -> None:
        """A remote prefill whose prompt is computed leaves the batch; held (with its blocks) until released."""
        self.running.remove(seq)
        self.seqs[seq.request_id] = seq

    def remove(self, request_id: str) -> bool:
        """Forget a request wherever it is and free its blocks (abort). False if unknown."""
        if request_id in self.reserved:
            self.reserved_prefix.pop(request_id, None)
            self.block_manager.free(self.reserved.pop(request_id))
            return True
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.joining:
            self.joining.remove(seq)
        if seq in self.done_early:
            self.done_early.remove(seq)
        self.swapped.pop(request_id, None)
        seq.swapped_kv = None
        self.free_blocks(seq)
        seq.status, seq.finish_reason = Status.FINISHED, "abort"
        return True

    def release(self, request_id: str) -> None:
        """Forget a held sequence and free its blocks. Unknown (or queued) ids are ignored."""
        seq = self.seqs.get(request_id)
        if seq is not None and seq not in self.running and seq not in self.waiting and seq not in self.joining:
            del self.seqs[request_id]
            self.free_blocks(seq)

    def add_reservation(self, request_id: str, block_table: list[int], prefix: tuple[int, ...] = ()) -> None:
        """Blocks held for a request; ``prefix``: the leading tokens whose KV they already hold."""
        self.reserved[request_id] = block_table
        if prefix:
            self.reserved_prefix[request_id] = prefix

    def reservation(self, request_id: str) -> list[int] | None:
        return self.reserved.get(request_id)

    def take_reservation(self, request_id: str) -> tuple[list[int], tuple[int, ...]]:
        """The reserved blocks (and the cached prefix they start with), now owned by the caller."""
        return self.reserved.pop(request_id), self.reserved_prefix.pop(request_id, ())

    def join_running(self, seq: Sequence) -> None:
        """A sequence whose prompt KV is already in its blocks joins the running batch."""
        seq.status = Status.RUNNING
        self.seqs[seq.request_id] = seq
        self.running.append(seq)

    def join_prefilled(self, seq: Sequence) -> None:
        """A prefilled sequence (its KV in its blocks) joins the running batch now, or with a ``join_gate`` waits
        in ``joining`` until ``admit_joining`` finds it room."""
        if self.join_gate is None:
            self.join_running(seq)
            return
        seq.status = Status.RUNNING
        self.seqs[seq.request_id] = seq
        self.joining.append(seq)

    def admit_joining(self) -> None:
        """Move waiting prefilled sequences into the batch, first come first, while the gate admits them."""
        if not self.joining:
            return
        ctx = sum(seq.num_tokens for seq in self.running)
        while self.joining:
            seq = self.joining[0]
            if self.join_gate is not None and not self.join_gate.admits(len(self.running), ctx, seq.num_tokens):
                return
            self.joining.popleft()
            self.running.append(seq)
            ctx += seq.num_tokens

    def finish_early(self, seq: Sequence) -> None:
        """A sequence finished outside a step: its blocks are freed, the next step reports it."""
        self.seqs.pop(seq.request_id, None)
        self.free_blocks(seq)
        self.done_early.append(seq)

    def take_done_early(self) -> list[Sequence]:
        done, self.done_early = self.done_early, []
        return done

    def finish(self, seq: Sequence) -> None:
        """A running sequence finished in this step: out of the queues and the table, blocks freed."""
        self.running.remove(seq)
        self.seqs.pop(seq.request_id, None)
        self.free_blocks(seq)

    def swap_out(self, seq: Sequence) -> None:
        """A running sequence whose KV was copied out: out of the batch, its blocks freed."""
        self.running.remove(seq)
        self.free_blocks(seq)
        seq.status = Status.SWAPPED
        self.swapped[seq.request_id] = seq

    def swap_in(self, seq: Sequence, block_table: list[int]) -> None:
        """A swapped sequence whose KV is back in ``block_table`` rejoins the batch."""
        del self.swapped[seq.request_id]
        seq.block_table, seq.block_hashes = block_table, []  # full blocks are registered again next step
        seq.status = Status.RUNNING
        self.running.append(seq)

    # ---- blocks of a sequence --------------------------------------------------------------
    def register_blocks(self, seq: Sequence) -> None:
        """Record the hashes of the blocks that became full (for prefix reuse)."""
        if seq.num_computed // self.block_manager.block_size <= len(seq.block_hashes):
            return  # no block became full since the last call
        self.block_manager.register_full_blocks(seq.block_table, seq.block_hashes, seq.num_computed, seq.all_ids)

    def free_blocks(self, seq: Sequence) -> None:
        if seq.block_table:
            self.block_manager.free(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> list[Sequence]:
        """The sequences of the next forward pass, each with its ``num_new`` tokens: prefill chunks (running
        prompts part-way first, then newly admitted ones), then decode rows; prefilled sequences waiting to
        join come in first, as the TBT bound allows."""
        self.admit_joining()
        decodes = self.schedule_decodes()
        prompts = self.schedule_prompts(self.max_num_batched_tokens - len(decodes))
        self.ask_ahead(prompts)
        return prompts + decodes

    def ask_ahead(self, step: list[Sequence]) -> None:
        """Remote prefills waiting for their grant (``remote_prefill.py``) that the step after ``step`` (this
        step's prompt work) may admit are asked for now, so that their decodes allocate while this step
        computes: in line order, while the prompt tokens still to compute ahead of them (part-way prompts after
        this step, then the waiting ones before them) stay within one step's budget."""
        ahead = sum(s.num_tokens - s.num_computed - (s.num_new if s in step else 0) for s in self.running
                    if s.status is Status.RUNNING and not _decode_ready(s))
        for seq in self.waiting:
            if ahead >= self.max_num_batched_tokens:
                break
            if not _granted(seq):
                seq.remote.ask()  # type: ignore[union-attr]
            ahead += seq.num_tokens - seq.num_computed

    def schedule_prompts(self, budget: int | None = None, admits: Admits | None = None) -> list[Sequence]:
        """The prompt work of one step within ``budget`` tokens (None: the whole step's budget), each sequence
        with its ``num_new``: the next chunk of every running prompt part-way, then waiting prompts admitted
        in order (``schedule_prefills``; ``admits`` as there). A running sequence at a decode row, or whose
        every token is computed (or in flight), gets nothing here. The pipeline engine's schedules call this
        for their prefill admission (``batch/pipeline/schedules.py``); ``schedule`` for a colocated step."""
        budget = self.max_num_batched_tokens if budget is None else budget
        chunks: list[Sequence] = []
        limit: int | None = None  # looked up once (against the step's budget), only for a prompt longer than a chunk
        step_budget = budget
        if self.solo_prompt_tokens:
            passing = self._short_passes(budget, admits)
            if passing:
                return passing
        for seq in self.running:
            if budget <= 0:
                break
            if seq.status is Status.RUNNING and not _decode_ready(seq):
                if limit is None and seq.num_tokens - seq.num_computed > self.chunk_tokens:
                    limit = self._limit(step_budget)
                seq.num_new = self._chunk(seq.num_computed, seq.num_tokens, min(budget, limit or budget))
                if seq.num_new:
                    budget -= seq.num_new
                    chunks.append(seq)
        partial = sum(1 for s in chunks if s.chunk_end < s.num_tokens)  # still part-way after this step
        return chunks + self.schedule_prefills(budget, partial, admits, in_step=sum(s.num_new for s in chunks))

    def _short_passes(self, budget: int, admits: Admits | None) -> list[Sequence]:
        """With ``solo_prompt_tokens``: while a short prompt waits to pass a long one part-way (``_limit``), the
        waiting prompts this step completes, in a step of their own (the long one sits it out); none (the long
        one goes on) when no short one waits or none can be admitted now."""
        part_way = [s for s in self.running if s.status is Status.RUNNING and not _decode_ready(s)]
        long = any(s.num_tokens - s.num_computed > self.chunk_tokens for s in part_way)
        if not long or self._limit(budget) >= budget:
            return []
        return self.schedule_prefills(budget, len(part_way), admits)

    def schedule_decodes(self) -> list[Sequence]:
        """Give every running sequence at a decode row a slot for its next token, preempting when blocks
        run out."""
        scheduled = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or not _decode_ready(seq):
                continue  # preempted below, or a prompt part-way (its blocks are all taken)
            while True:
                try:
                    self.block_manager.append_slots(seq.block_table, seq.num_tokens)
                    seq.num_new = 1
                    scheduled.append(seq)
                    break
                except OutOfBlocksError:
                    victim = self._pick_victim()
                    if victim is None:
                        raise  # cannot happen: add_request refuses what can never fit
                    self.preempt(victim)
                    if victim is seq:
                        break
                    if victim in scheduled:
                        scheduled.remove(victim)
        return scheduled

    def schedule_prefills(self, budget: int | None = None, partial: int = 0,
                          admits: Admits | None = None, in_step: int = 0) -> list[Sequence]:
        """Admit waiting sequences in order while blocks, max_num_seqs and the token budget allow; each
        computes its first chunk in this step. One that would stay part-way after it keeps its place while
        ``max_partial_prefills`` prompts already are (``partial``), and a shorter one behind it that this
        step finishes may go: two long prompts run one after the other, not interleaved (which would delay
        the first one's first token by the second one's compute), and short prompts pass both.
        ``admits(seq)``, when given, is asked last, once its blocks are taken: False stops admission here
        (its blocks go back; it keeps its place); True admits it (nothing after refuses it, so the caller
        may count it in). TD-Pipe's prefill phase passes its KV-memory simulation (``switch.FutureMemory``).
        ``in_step``: prompt tokens the step already has; with ``solo_prompt_tokens`` a prompt joins a step that
        has some only while the two together stay within it (else it waits for the next step, in its place)."""
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens if budget is None else budget
        reach = budget  # the step's budget less every prompt in line so far, granted or not: what may be asked for
        for seq in list(self.waiting):
            if len(self.running) >= self.max_num_seqs or budget <= 0:
                break
            if not _granted(seq):  # it keeps its place; its decode is asked for blocks now (it goes once granted)
                if reach > 0:
                    seq.remote.ask()  # type: ignore[union-attr]
                reach -= seq.num_tokens - seq.num_computed
                continue
            ids = seq.all_ids
            try:
                # a request that wants its prompt's logprobs needs every position's logits: no prefix hit
                table, cached = self.block_manager.allocate(ids, len(ids), use_prefix_cache=not seq.needs_prompt_logits)
            except OutOfBlocksError:
                break  # wait for blocks to free up
            long = len(ids) - cached > self.chunk_tokens  # only then may a short prompt behind it cut its chunk
            n = self._chunk(cached, len(ids), self._limit(budget, after=seq) if long else budget)
            if self.solo_prompt_tokens and in_step and in_step + n > self.solo_prompt_tokens:
                self.block_manager.free(table)
                break  # it runs in a step of its own, next
            if cached + n < len(ids):
                if partial >= self.max_partial_prefills:  # it keeps its place; a shorter one behind it may go
                    self.block_manager.free(table)
                    continue
                partial += 1
            if admits is not None and not admits(seq):
                self.block_manager.free(table)
                break
            self.waiting.remove(seq)
            seq.block_table, seq.num_computed, seq.num_new = table, cached, n
            if not seq.output_ids:
                seq.num_cached_tokens = cached
            budget, in_step, reach = budget - n, in_step + n, reach - n
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled.append(seq)
        return scheduled

    def _limit(self, budget: int, after: Sequence | None = None) -> int:
        """The most tokens of one prompt in this step: the whole ``budget``, unless a short prompt waits (one
        of the first ``SHORT_SCAN`` waiting after ``after`` whose prompt, less its prefix-cache hit, fits
        beside a chunk of ``chunk_tokens``): then ``chunk_tokens``, so that it passes the long prompt now."""
        if self.chunk_tokens >= budget:
            return budget
        waiting = list(self.waiting)
        start = waiting.index(after) + 1 if after is not None else 0
        for seq in waiting[start:start + SHORT_SCAN]:
            hit = 0 if seq.needs_prompt_logits else len(self.block_manager.match_prefix(seq.all_ids))
            if seq.num_tokens - hit * self.block_manager.block_size <= budget - self.chunk_tokens:
                if _granted(seq):
                    return self.chunk_tokens
                seq.remote.ask()  # type: ignore[union-attr]  # it passes once granted (a step from now)
        return budget

    def _chunk(self, done: int, total: int, limit: int) -> int:
        """Tokens of a sequence (``done`` of ``total`` computed) to compute in this step: all that are left,
        at most ``limit``; a chunk before the last ends on a block boundary when it can (each block's KV is
        then written, and pushed, by one step)."""
        left = total - done
        n = min(left, limit)
        if 0 < n < left:
            aligned = done + n - (done + n) % self.block_manager.block_size
            if aligned > done:
                n = aligned - done
        return max(n, 0)

    def _pick_victim(self) -> Sequence | None:
        # never a reserved one (decode side) nor a remote prefill (its pushed KV cannot be taken back)
        candidates = [s for s in self.running if not s.reserved and s.remote is None and s.status is Status.RUNNING]
        return max(candidates, key=lambda s: s.arrival) if candidates else None

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it goes back to the head of ``waiting`` to be recomputed."""
        self.num_preemptions += 1
        self.running.remove(seq)
        self.free_blocks(seq)
        seq.num_computed = 0
        if not seq.prompt_logprobs_sent:  # a prompt part-way: its prompt logprobs are recomputed with it
            seq.prompt_logprobs = None
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)


def _granted(seq: Sequence) -> bool:
    """Whether a waiting sequence may be computed: every one but a remote prefill waiting for its grant."""
    return seq.remote is None or seq.remote.granted


def _decode_ready(seq: Sequence) -> bool:
    """One token left to compute and some already computed: a decode row (else a prompt chunk)."""
    return seq.num_tokens - seq.num_computed == 1 and seq.num_computed > 0
