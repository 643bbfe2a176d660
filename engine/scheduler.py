"""Scheduler: where every request is (waiting, running, held, reserved) and what runs next.

Owns the request table and the queues; the BlockManager it is given does the block
accounting. Pure Python (no torch).

Places a request can be, by request id:
- ``waiting`` (FIFO deque) then ``running`` (list): the colocated path and P/D decodes.
- held: prefilled by ``prefill_only`` on the prefill side, in ``seqs`` but in neither queue,
  until released.
- ``reserved``: blocks taken by ``reserve`` on the decode side, before ``add_prefilled`` (or
  ``prefill_reserved``); ``reserved_prefix`` holds the token ids of a reservation's leading
  tokens whose KV came from the prefix cache (its first blocks are shared, cached ones).
- ``done_early``: finished outside a step (by its first token); the next step reports it.
- ``swapped``: running sequences evicted to host memory (``swap.py``): in ``seqs``, in no
  queue, no blocks, until ``swap_in``.

``schedule()`` for one step (prefill spans first, then decode rows):
1. every running sequence gets a slot for its next token; when blocks run out, the newest
   colocated (not reserved) running sequence is preempted: its blocks are freed and it goes
   back to the head of ``waiting`` to be recomputed (``num_preemptions`` counts these);
2. waiting sequences are admitted FIFO while blocks, ``max_num_seqs`` and the prefill token
   budget ``max_num_batched_tokens`` allow (the first one is admitted whatever its size).

Who frees: ``finish`` (a finished running sequence), ``remove`` (abort) and ``free_blocks``
drop a sequence's block references exactly once; a reservation is freed by ``remove`` or
handed over to its sequence by the caller.
"""

from __future__ import annotations

from collections import deque

from .block_manager import BlockManager
from .errors import OutOfBlocksError
from .sequence import Sequence, Status


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}  # waiting, running, or prefilled-and-held
        self.reserved: dict[str, list[int]] = {}  # decode side: request id -> block table
        self.reserved_prefix: dict[str, tuple[int, ...]] = {}  # request id -> the cached tokens it reused
        self.done_early: list[Sequence] = []  # finished outside step(); reported by the next step
        self.swapped: dict[str, Sequence] = {}  # evicted to host memory, the first evicted first
        self.num_preemptions = 0  # colocated sequences freed and recomputed for lack of blocks

    # ---- the request table -----------------------------------------------------------------
    def in_use(self, request_id: str) -> bool:
        return request_id in self.seqs or request_id in self.reserved

    def request_ids(self) -> list[str]:
        """Every request holding state: waiting, running, held, or reserved."""
        return list(self.seqs) + list(self.reserved)

    def num_requests(self) -> int:
        return len(self.seqs) + len(self.reserved)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.done_early)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the end of ``waiting``."""
        self.seqs[seq.request_id] = seq
        self.waiting.append(seq)

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
        if seq in self.done_early:
            self.done_early.remove(seq)
        self.swapped.pop(request_id, None)
        seq.swapped_kv = None
        self.free_blocks(seq)
        seq.status, seq.finish_reason = Status.FINISHED, "abort"
        return True

    def hold(self, seq: Sequence) -> None:
        """Keep a prefilled sequence (and its blocks) in the table, in neither queue, until released."""
        self.seqs[seq.request_id] = seq

    def release(self, request_id: str) -> None:
        """Forget a held sequence and free its blocks. Unknown (or queued) ids are ignored."""
        seq = self.seqs.get(request_id)
        if seq is not None and seq not in self.running and seq not in self.waiting:
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
        """The sequences of the next forward pass: admitted prefills, then running decodes."""
        decodes = self.schedule_decodes()
        prefills = self.schedule_prefills()
        return prefills + decodes

    def schedule_decodes(self) -> list[Sequence]:
        """Give every running sequence a slot for its next token, preempting when blocks run out."""
        scheduled = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted below
            while True:
                try:
                    self.block_manager.append_slots(seq.block_table, seq.num_tokens)
                    scheduled.append(seq)
                    break
                except OutOfBlocksError:
                    victim = self._pick_victim()
                    if victim is None:
                        raise  # cannot happen: add_request refuses what can never fit
                    self._preempt(victim)
                    if victim is seq:
                        break
                    if victim in scheduled:
                        scheduled.remove(victim)
        return scheduled

    def schedule_prefills(self) -> list[Sequence]:
        """Admit waiting sequences FIFO while blocks, max_num_seqs and the token budget allow."""
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            ids = seq.all_ids
            try:
                # a request that wants its prompt's logprobs needs every position's logits: no prefix hit
                table, cached = self.block_manager.allocate(ids, len(ids), use_prefix_cache=not seq.needs_prompt_logits)
            except OutOfBlocksError:
                break  # wait for blocks to free up
            if scheduled and len(ids) - cached > budget:
                self.block_manager.free(table)
                break
            self.waiting.popleft()
            budget -= len(ids) - cached
            seq.block_table, seq.num_computed = table, cached
            if not seq.output_ids:
                seq.num_cached_tokens = cached
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled.append(seq)
        return scheduled

    def _pick_victim(self) -> Sequence | None:
        candidates = [s for s in self.running if not s.reserved and s.status is Status.RUNNING]
        return max(candidates, key=lambda s: s.arrival) if candidates else None

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self.free_blocks(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
