"""One decode of the virtually clocked cluster: its KV blocks are the real BlockManager's, its steps the profile's.

- **reserve** (the Session's Allocation): ``BlockManager.allocate`` of prompt + max_tokens blocks, the prompt's
  longest cached prefix reused when the prefill asks (``--decode-reuse``, the default): those leading blocks are
  pinned and their KV does not move (``decode_cached_blocks``).
- **join** (``add_prefilled``, when the last KV slice arrived): the prompt's full blocks are registered in the
  prefix cache (KV events to the prefills' decode index) and the request joins the running batch at the next
  step boundary (at most ``max_num_seqs`` rows; the rest wait in arrival order).
- **steps**: each lasts ``StepTime.decode_s``'s terms over the rows' contexts (``step_s([], contexts)``, the same
  function the sim engine's runner sleeps); every row gets a token; a row with its ``n_out - 1`` tokens (the
  prefill sampled the first) finishes at that step's end and its blocks are freed to the prefix cache.

Not modelled: the generated tokens' blocks (the sim's tokens are a hash, no later prompt of the trace holds them,
so the real decode's cache entries for them are never hit; they would only take evictable room), preemption (a
reservation is never preempted) and the decode's own prompt computation (``--disaggregation always``).
A step whose end is before every other pending event is taken without the event heap (``Clock.next_time``).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.errors import OutOfBlocksError
from pdserve.engine.sim.profile import StepTime
from pdserve.prefill_server.picker import DecodeLoad

from .virtual_clock import Clock, VRequest
from .virtual_prefill import IndexFeed


class VirtualDecode:
    def __init__(self, address: str, clock: Clock, step: StepTime, num_blocks: int, block_size: int,
                 block_bytes: int, max_num_seqs: int, index):
        self.address, self.clock, self.step, self.block_size = address, clock, step, block_size
        self.block_bytes, self.max_num_seqs = block_bytes, max_num_seqs
        self.blocks = BlockManager(num_blocks, block_size)
        self.feed = IndexFeed(index, address, block_size) if index is not None else None
        self.blocks.listener = self.feed
        self.rows: list[list] = []  # [request, tokens left, context]
        self.joining: deque[VRequest] = deque()
        self.busy = False
        self.busy_s = 0.0  # modelled seconds of its steps
        self.steps = 0
        self.on_finish: Callable[[VRequest], None] = lambda r: None

    def load(self) -> DecodeLoad:
        free = self.blocks.num_free_blocks()
        return DecodeLoad(free_blocks=free, free_bytes=free * self.block_bytes, total_blocks=self.blocks.num_blocks,
                          running=len(self.rows), waiting=len(self.joining))

    def reserve(self, r: VRequest, use_prefix: bool = True) -> bool:
        assert r.ids is not None
        try:
            table, cached = self.blocks.allocate(r.ids, r.n_prompt + r.n_out, use_prefix_cache=use_prefix)
        except OutOfBlocksError:
            return False
        r.decode, r.decode_table, r.decode_cached_blocks = self.address, table, cached // self.block_size
        return True

    def join(self, r: VRequest) -> None:
        assert r.ids is not None
        self.blocks.register_full_blocks(r.decode_table, [], r.n_prompt, r.ids)
        r.ids = None
        if self.feed is not None:
            self.feed.flush()
        if r.n_out <= 1:  # the first token was its last
            self.clock.at(self.clock.now, self._finish, r)
            return
        self.joining.append(r)
        if not self.busy:  # its first step starts now, as an event: the caller's handler keeps this time
            self.busy = True
            self.clock.at(self.clock.now, self._begin)

    def _begin(self) -> None:
        while self.joining and len(self.rows) < self.max_num_seqs:
            r = self.joining.popleft()
            self.rows.append([r, r.n_out - 1, r.n_prompt + 1])
        if not self.rows:
            self.busy = False
            return
        self.busy = True
        clock = self.clock
        while True:
            seconds = self.step.step_s([], [row[2] for row in self.rows])
            self.busy_s += seconds
            self.steps += 1
            end = clock.now + seconds
            if end >= clock.next_time() or self.joining:
                clock.at(end, self._step_end)
                return
            clock.now = end  # nothing else happens before this step ends: take it here
            self._tokens()
            if not self.rows:
                self.busy = False
                return

    def _step_end(self) -> None:
        self._tokens()
        self._begin()

    def _tokens(self) -> None:
        left = []
        for row in self.rows:
            row[1] -= 1
            row[2] += 1
            if row[1] > 0:
                left.append(row)
            else:
                self._finish(row[0])
        self.rows = left

    def cancel(self, r: VRequest) -> None:
        """Its prefill failed: the reservation is freed."""
        if r.decode_table:
            self.blocks.free(r.decode_table)
            r.decode_table = []

    def _finish(self, r: VRequest) -> None:
        r.finish_at = self.clock.now
        self.blocks.free(r.decode_table)
        r.decode_table = []
        if self.feed is not None:
            self.feed.flush()
        self.on_finish(r)

