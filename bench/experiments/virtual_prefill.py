"""One prefill of the virtually clocked cluster: the real simulated engine, stepped by events.

What is the product's own code here: ``SimEngine`` (``engine/sim``: the real EngineCore, Scheduler,
BlockManager and prefix cache with its evictions, chunked prefill under ``max_num_batched_tokens``, the remote
prefill's per-layer KV hand-over and hold/release, the profile's step time ``StepTime.step_s`` spent layer by
layer by ``SimRunner``), the prefill's ``DecodePicker`` (``prefill_server/picker.py``) and the modelled link
(``cachestore/link_model.LinkModel``). What is modelled after the prefill server (``prefill_server/conductor.py``,
``decode_session.py``), in simulated time:

1. a routed request enters the engine's Scheduler at once as a remote prefill waiting for its grant
   (``engine.pd.add_remote(..., want=...)``, ``engine/remote_prefill.py``; the SessionRunner's step 0, "line"): it
   keeps its place in line, holds nothing on any decode and is never computed before its grant;
2. the Scheduler calls its ``want`` once, during a step's scheduling: when the step reaches it in line, when the
   step expects the next one to admit it (``Scheduler.ask_ahead``: one step's budget of prompt tokens ahead), or
   when it is short enough to pass a long prompt part-way (``_limit``). Then (at the step's start: the
   Allocation's round trip costs no simulated time) the picker picks a decode (with the decodes' prefix overlap,
   ``--decode-reuse``), which reserves prompt + max_tokens blocks (its own prefix cache may hold leading ones:
   those do not move); ``note_allocation`` as the prefill's transfer accounting does; and ``engine.pd.grant``
   lets the engine compute it from its next step on. If no decode can take it, it waits (wanted requests in the
   order they were wanted, only the first one trying: the server's AdmissionQueue) for a decode to free blocks,
   ungranted in its place in the engine's line, while the prompts behind it go on. Where this differs from the
   server: its conductor picks the decode when the request arrives, before the line (one that no decode has
   room for then waits in the AdmissionQueue before it enters the engine's line), and opens the Session to it
   at ``want``; a refusal then takes the prompt out of the engine's line, and its next attempt enters it again
   at the end. Here the pick is made at ``want``, with the load reports of that moment, and a wanted request
   that no decode can take keeps its place in the engine's line;
3. the engine is stepped when idle and work waits. ``SimRunner``'s sleep is this module's ``_sleep``, which only
   moves a cursor, so a step runs at once and its layers' times are known: after each layer ``on_layer`` queues
   that layer's new blocks (past the decode's cached ones) on the prefill's one modelled wire at the cursor's
   time (``LinkModel.delivery_time``); the step's end is an event. A step that computed nothing (every prompt
   in line waiting for its grant) ends at once: the grants its wants gave are stepped right after it;
4. at the step's end its KV events (the BlockManager's listener) reach the router's index; its first token
   reaches the client when its last KV slice was delivered (step 5r: the FirstToken waits for every layer
   sent), and then the engine's held blocks are released and the decode takes it (``virtual_decode.py``).

Load reports: the router reads ``in_flight`` (requests this prefill streams, first line to last token) and free
blocks as polled every ``load_interval_s``; the picker's decode reports likewise (``VirtualPrefill.poll``).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from pdserve.cachestore.link_model import LinkModel
from pdserve.engine.block_manager import reusable_hashes
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.errors import OutOfBlocksError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sim.engine import SimEngine
from pdserve.engine.sim.profile import SimProfile
from pdserve.engine.sim.runner import SimRunner
from pdserve.engine.tokenizer import ByteTokenizer
from pdserve.kv_index import CLEARED, REMOVED, STORED, PrefixIndex
from pdserve.prefill_server.picker import DecodePicker
from pdserve.prefill_server.session_protocol import decode_reservation

from .virtual_clock import Clock, VRequest

EPOCH = "virtual"


class IndexFeed:
    """A BlockManager listener whose events reach a PrefixIndex (as ``kv_follow`` applies them), numbered, when
    ``flush`` is called: a prefill's at the end of the step that made them."""

    def __init__(self, index: PrefixIndex, server: str, block_size: int):
        self.index, self.server = index, server
        self.pending: list[tuple[str, list[int]]] = []
        self.seq = 0
        index.apply_snapshot(server, EPOCH, 0, [], block_size)

    def stored(self, hashes: list[int]) -> None:
        self.pending.append((STORED, list(hashes)))

    def removed(self, hashes: list[int]) -> None:
        self.pending.append((REMOVED, list(hashes)))

    def cleared(self) -> None:
        self.pending.append((CLEARED, []))

    def flush(self) -> None:
        for kind, hashes in self.pending:
            self.seq += 1
            verdict = self.index.apply_event(self.server, EPOCH, self.seq, kind, hashes)
            if verdict != "applied":
                raise RuntimeError(f"KV event {self.seq} of {self.server}: {verdict}")
        self.pending = []


class FixedTokenRunner(SimRunner):
    """``SimRunner`` (its step time, layers and callbacks) whose first token is a constant: the decode is modelled
    (its tokens are never read), so hashing every prompt for a token would only cost time."""

    def next_token(self, request_id: str, ids: list[int], n: int) -> int:
        return self.vocabulary[0]


class VirtualPrefill:
    def __init__(self, address: str, clock: Clock, profile: SimProfile, config: EngineConfig, link: LinkModel,
                 picker: DecodePicker, decodes: dict, decode_index: PrefixIndex | None, router_index: PrefixIndex,
                 load_interval_s: float = 0.3):
        self.address, self.clock, self.picker, self.decodes = address, clock, picker, decodes
        self.decode_index, self.load_interval_s = decode_index, load_interval_s
        self.engine = SimEngine(profile, ByteTokenizer(), config)
        self.engine.runner = FixedTokenRunner(profile, self.engine.runner.vocabulary, self._sleep)
        self.feed = IndexFeed(router_index, address, config.block_size)
        self.engine.block_manager.listener = self.feed
        self.link, self.block_size = link, config.block_size
        self.layer_bytes = self.engine.kv_cache.block_nbytes  # one block of one layer, real bytes
        link.clock = lambda: self.cursor
        self.cursor = 0.0  # the engine's time inside a step (its sleeps move it)
        self.wanted: deque[VRequest] = deque()  # wanted by the Scheduler, no decode allocated yet (want order)
        self.in_flight = 0  # requests this prefill streams (the load report's)
        self.busy = False
        self._done: list[tuple[VRequest, int | None, BaseException | None]] = []
        self._polled = -1.0
        self.on_first_token: Callable[[VRequest], None] = lambda r: None
        self.failed: Callable[[VRequest], None] = lambda r: None

    def _sleep(self, seconds: float) -> None:
        self.cursor += seconds

    @property
    def busy_s(self) -> float:
        return self.engine.runner.modelled_s

    # ---- the engine's line and the decode's allocation ------------------------------------------
    def arrive(self, r: VRequest) -> None:
        """Into the engine's line at once, ungranted: nothing is asked of a decode until the Scheduler wants it."""
        self.in_flight += 1
        if r.ids is None:
            r.ids = list(r.prompt)
        try:
            self.engine.pd.add_remote(str(r.index), r.ids, SamplingParams(max_tokens=max(1, r.n_out)),
                                      on_layer=self._on_layer(r), on_done=self._on_done(r), want=self._want(r))
        except (ValueError, OutOfBlocksError) as exc:  # the engine refused it (too long for its pool)
            r.error = f"prefill refused it: {exc}"
            self.failed(r)
            return
        self.kick()

    def _want(self, r: VRequest):
        def want() -> None:  # in the engine's step (its scheduling): allocated and granted after it
            self.wanted.append(r)
        return want

    def admit(self) -> bool:
        """The wanted requests, in the order they were wanted, get a decode's allocation and their grant, until
        one finds no decode that can take it now (a decode freeing blocks calls this again); whether any was
        granted."""
        granted = False
        while self.wanted:
            r = self.wanted[0]
            if not self._allocate(r):
                break
            self.wanted.popleft()
            if not self.engine.pd.grant(str(r.index)):
                raise RuntimeError(f"request {r.index} was wanted but is not waiting in the engine any more")
            granted = True
        return granted

    def decode_freed(self) -> None:
        """A decode freed blocks: the wanted requests waiting for one try again (and are stepped once granted)."""
        if self.wanted and self.admit():
            self.kick()

    def _allocate(self, r: VRequest) -> bool:
        self.poll()
        assert r.ids is not None
        need = decode_reservation(r.n_prompt, r.n_out, self.block_size)
        overlap, blocks = {}, 0
        if self.decode_index is not None:
            hashes = reusable_hashes(r.ids, self.block_size)
            overlap = {a: self.decode_index.overlap(a, hashes) for a in self.picker.known()}
            blocks = len(hashes)
        address = self.picker.pick(blocks_needed=need, overlap=overlap, prompt_blocks=blocks)
        if address is None:
            return False
        decode = self.decodes[address]
        if not decode.reserve(r, use_prefix=self.decode_index is not None):
            return False
        self.picker.note_allocation(address, need, need * self.layer_bytes * self.engine.kv_cache.num_layers)
        r.allocated_at = self.clock.now
        return True

    def poll(self) -> None:
        """The decodes' load reports, when the last round is ``load_interval_s`` old (a poller's round)."""
        if self.clock.now - self._polled < self.load_interval_s:
            return
        self._polled = self.clock.now
        self.picker.round_started()
        for address, decode in self.decodes.items():
            self.picker.update(address, decode.load())

    # ---- the engine's steps --------------------------------------------------------------------
    def _on_layer(self, r: VRequest):
        def on_layer(layer: int, block_ids: list[int], first: int) -> None:
            moving = len(block_ids) - max(0, r.decode_cached_blocks - first)
            if moving > 0:
                r.kv_at = self.link.delivery_time(moving * self.layer_bytes)
        return on_layer

    def _on_done(self, r: VRequest):
        def on_done(token: int | None, error: BaseException | None) -> None:
            self._done.append((r, token, error))
        return on_done

    def kick(self) -> None:
        """A step of the engine now, if it is idle and work waits. The wants of the step's scheduling are allocated
        and granted at its start (the Allocation's round trip costs no simulated time): a step that computed
        nothing because every prompt in line waited for its grant is followed at once by one that computes them."""
        while not self.busy and self.engine.has_unfinished():
            start = self.cursor = self.clock.now
            before = self.engine.runner.modelled_s
            self.engine.step()
            granted = self.admit()
            if self.engine.runner.modelled_s == before and not self._done:
                if granted:
                    continue
                return  # nothing could be scheduled (no free blocks, no grant): a release or a decode kicks again
            self.busy = True
            self.clock.at(max(self.cursor, start), self._step_end)

    def _step_end(self) -> None:
        self.busy = False
        self.feed.flush()
        done, self._done = self._done, []
        for r, _token, error in done:
            if error is not None:
                r.error = f"prefill failed: {error}"
                self.failed(r)
                continue
            r.computed_at = self.clock.now
            r.prefill_cached = self.engine.scheduler.seqs[str(r.index)].num_cached_tokens
            self.clock.at(max(self.clock.now, r.kv_at), self._first_token, r)
        self.kick()

    def _first_token(self, r: VRequest) -> None:
        r.first_at = self.clock.now
        self.engine.pd.release(str(r.index))
        self.feed.flush()
        self.on_first_token(r)
        self.kick()

    def finished(self, r: VRequest) -> None:
        """Its last token went out: it leaves this prefill's load."""
        self.in_flight -= 1
