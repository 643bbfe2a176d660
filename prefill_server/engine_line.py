"""EngineLine: P/D prompts waiting in our engine's Scheduler for a decode to hold their KV (step 0 of a request).

Request lifecycle of one ``LinePlace`` (one prompt of one request; the conductor keeps it across its attempts):

1. **enter** - ``EngineLine.enter``: the prompt goes into our engine at once as a remote prefill waiting for
   its grant (``engine.prefill_only(..., want=...)``, ``engine/remote_prefill.py``): it keeps its place in
   the Scheduler's line and is never computed before its grant; nothing is held on any decode meanwhile.
2. **wanted** - ``LinePlace.wanted`` returns once the Scheduler wants it (a step reached it, or the step before
   expects the next one to admit it), or at once when the prompts ahead of it in our engine (entered, not yet
   computed) hold less than a step's budget of tokens (``line_tokens``): the Scheduler's own ask-ahead rule,
   applied on arrival, because the engine thread only sees a new prompt after the step in progress, and the
   decode's allocation should overlap that step, not follow it. Only now is a decode picked and asked for
   blocks, with the decodes' load of this moment. If that decode refuses (full, unreachable), the place
   stays wanted, in its place, for the next decode tried: a retry never goes to the back of the line.
3. **grant** - ``LinePlace.grant(on_layer)``: a decode allocated and the push is bound; from here the engine
   computes it (chunked, batched), each written layer goes to ``on_layer``, and the Session's run owns it.
4. **first token** - ``LinePlace.first_token``: its first token once computed (the engine then holds its
   blocks until ``release``).
5. **leave** - ``LinePlace.leave``: out of the line uncomputed (the decode computes the prompt, the request
   ended, a resume needs a longer prompt); a cancel of the engine's wait, whose abort frees anything taken.

``EngineLine.queued_tokens``: prompt tokens entered and not yet computed (or gone): with an SLO policy the
admission line lets its head go on only while they stay under ``line_tokens`` (``has_room``), and
``on_room`` is called each time a prompt leaves them.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Callable

from .session_protocol import Retryable

if TYPE_CHECKING:
    from pdserve.engine import SamplingParams
    from pdserve.engine.server_engine import ServerEngine

OnLayer = Callable[[int, list[int], int], None]


class LinePlace:
    """One prompt's place in our engine's line (module docstring)."""

    def __init__(self, line: EngineLine, engine_id: str, prompt_ids: list[int], sp: SamplingParams):
        self.line, self.engine_id, self.num_tokens = line, engine_id, len(prompt_ids)
        self._wanted = asyncio.Event()
        self._on_layer: OnLayer | None = None  # where its layers go, set by grant
        self.granted = False
        self.left = False

        def engine_on_layer(layer: int, block_ids, first: int) -> None:  # the engine thread, only once granted
            assert self._on_layer is not None
            self._on_layer(layer, block_ids, first)

        self._engine_on_layer = engine_on_layer  # what the engine holds (its kv_direct is read at each step)
        self.task: asyncio.Future = asyncio.ensure_future(line.engine.prefill_only(
            engine_id, prompt_ids, sp, on_layer=engine_on_layer, want=self.want))
        self.task.add_done_callback(lambda _: line.computed(self.num_tokens))

    def want(self) -> None:
        """Wanted now (what the Scheduler's ``want`` says; also ``EngineLine.enter``'s own rule)."""
        self._wanted.set()

    @property
    def computed(self) -> bool:
        """Our engine computed the prompt (its first token came): it holds the prompt's blocks until released."""
        return self.task.done() and not self.task.cancelled() and self.task.exception() is None

    @property
    def waiting(self) -> bool:
        """In line, not granted yet: a decode may still be picked for it."""
        return not self.granted and not self.left and not self.task.done()

    async def wanted(self) -> None:
        """Step 2: returns once the Scheduler wants it; Retryable ``prefill_busy`` when the prompt can never fit
        our pool (the engine's answer to the add), or what else the engine raised."""
        if not self._wanted.is_set():
            waiting = asyncio.ensure_future(self._wanted.wait())
            try:
                await asyncio.wait({waiting, self.task}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiting.cancel()
        if self.task.done():
            await self.first_token()

    async def grant(self, on_layer: OnLayer, kv_direct: bool = False) -> None:
        """Step 3: computed from now on, each written layer to ``on_layer`` (``kv_direct``: the per-rank push reads
        every rank's own pool, remote_prefill.py)."""
        self._on_layer = on_layer
        setattr(self._engine_on_layer, "kv_direct", kv_direct)
        self.granted = True
        await self.line.engine.grant(self.engine_id)  # False: it failed or was aborted, which first_token says

    async def first_token(self) -> int:
        """Step 4: the first token once computed; Retryable ``prefill_busy`` for a prompt our pool can never hold.
        Cancelling the wait leaves the line (the engine's abort frees what it took)."""
        try:
            return await self.task
        except self.line.out_of_blocks_error as exc:
            raise Retryable(f"prefill has no free KV blocks for this prompt now: {exc}", "prefill_busy") from None
        except asyncio.CancelledError:
            self.leave()
            raise

    def leave(self) -> None:
        """Step 5 (idempotent): out of the line; the engine's abort (queued behind a step that may be computing it)
        frees anything it took, and its blocks' release is queued behind that too."""
        self.left = True
        if self.task.done():
            if not self.task.cancelled():
                self.task.exception()  # retrieved: a failure was reported where it was awaited
            return
        self.task.cancel()
        self.line.release_later(self.engine_id)


class EngineLine:
    """Our engine's line as the prefill sees it: where places are made, and how many prompt tokens wait in it."""

    def __init__(self, engine: ServerEngine, line_tokens: int, out_of_blocks_error: type[Exception],
                 release_later: Callable[[str], None]):
        self.engine, self.line_tokens, self.out_of_blocks_error = engine, line_tokens, out_of_blocks_error
        self.release_later = release_later  # queue a release of the engine's blocks without waiting for it
        self.queued_tokens = 0  # prompt tokens entered and not yet computed (or gone)
        self.on_room: Callable[[], None] | None = None  # a prompt left them (the admission line's head may go)

    def enter(self, engine_id: str, prompt_ids: list[int], sp: SamplingParams) -> LinePlace:
        """Step 1: a new place at the end of the line (in the engine's order of arrival), wanted at once when
        less than a step's budget of prompt tokens is ahead of it (step 2)."""
        ahead, self.queued_tokens = self.queued_tokens, self.queued_tokens + len(prompt_ids)
        place = LinePlace(self, engine_id, prompt_ids, sp)
        if ahead < self.line_tokens:
            place.want()
        return place

    def computed(self, tokens: int) -> None:
        self.queued_tokens -= tokens
        if self.on_room is not None:
            self.on_room()

    def has_room(self) -> bool:
        """Whether less than ``line_tokens`` prompt tokens wait in the line (with an SLO policy the admission line's
        head goes on only then: the policy, not arrival, orders what our engine computes)."""
        return self.queued_tokens < self.line_tokens
