"""PDHooks: the engine's prefill/decode disaggregation primitives, on each side.

An LLMEngine builds one and holds it as ``engine.pd``; these methods are the implementation
(LLMEngine does not repeat them). Call them on the thread that steps the engine: AsyncLLMEngine
runs them on its engine thread, kvpool and the synchronous tests call them directly. A
request's blocks are freed by ``LLMEngine.abort`` too, wherever it is.

Prefill side (the prompt's KV is computed here and sent elsewhere):
- ``add_remote`` queues a *remote prefill*, a kind of request the one Scheduler admits, chunks
  and batches with every other (``remote_prefill.py``): ``on_layer(layer, block_ids, first)``
  hands over each layer's newly complete blocks as every chunk is written, ``on_done(token,
  error)`` reports its first token (it is then held) or why it failed (its blocks freed). A
  request with ``prompt_logprobs`` computes its whole prompt, no prefix hit, and keeps the
  prompt's logprobs for ``prefill_prompt_logprobs``. With ``want`` it waits in line until
  ``grant(request_id)`` (its decode allocated): ``want()`` is called once, when the Scheduler
  would compute it.
- ``prefill_many`` (and ``prefill_only`` for one prompt) do the same synchronously, for tests and
  the memory profile: blocks taken now (OutOfBlocksError if not free), the engine stepped until
  every prompt has its first token; all or nothing (any error frees every block taken).
- Who frees: the caller, with ``release(request_id)`` once the KV is sent (or ``abort``).
- ``prefill_counters``: (``prefill_tokens``, ``prefill_seconds``): remote prompt tokens computed
  (prefix hits excluded) and their share of the steps that computed them (the measured throughput).

Decode side (the prompt's KV arrives from elsewhere):
- ``reserve`` takes blocks for prompt + max_tokens up front, so the request is never
  preempted; OutOfBlocksError (with the reason) when impossible. The prompt's KV must be
  written into the first ``blocks_needed(num_prompt_tokens, block_size)`` of them.
- ``reserve_prefix`` is ``reserve`` that first reuses the longest cached prefix of the prompt
  (at most ``(n_prompt - 1) // block_size`` blocks, as the colocated prefix cache): it returns
  the block ids and ``num_cached`` tokens whose KV those leading blocks already hold. They are
  shared with the prefix cache (and any request holding them) and pinned by the reservation:
  no eviction can take them until the request ends. Only the prompt's KV after ``num_cached``
  has to be written (into ``block_ids[num_cached // block_size : blocks_needed(n_prompt)]``).
- ``add_prefilled`` joins the request to the running batch; its outputs start after the first
  token (prefill reported that one). If the first token already ends the request, the next
  step reports it finished with no tokens.
- ``prefill_reserved`` instead computes the prompt's missing KV here (after ``num_cached``)
  in the next step, then decodes: every token, the first one included, is an output.
  Reserved, so never preempted.
- Both check that the prompt starts with the tokens the reservation's cached prefix holds.
- Who frees: the engine when the request finishes, or ``abort`` (also before add_prefilled).
"""

from __future__ import annotations

import math
import time
from typing import Callable

from .block_manager import blocks_needed
from .errors import OutOfBlocksError, PromptTooLongError, TbtBoundError
from .outputs import OutputProcessor
from .remote_prefill import OnDone, OnLayer, RemotePrefill, Want, blocks_to_push
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import RequestOutput, Sequence, SequenceFactory, Status
from .step_budget import TbtBudget


class PDHooks:
    def __init__(self, scheduler: Scheduler, factory: SequenceFactory, outputs: OutputProcessor, max_model_len: int,
                 step: Callable[[], list[RequestOutput]]):
        self.scheduler, self.factory, self.outputs = scheduler, factory, outputs
        self.block_manager = scheduler.block_manager
        self.max_model_len = max_model_len
        self.step = step  # the engine's step (the synchronous prefill_many steps until its prompts are done)
        self.other_outputs: list[RequestOutput] = []  # other requests' outputs of those steps: the next step's
        self.prefill_tokens = 0  # prompt tokens computed for remote prefills (prefix hits excluded)
        self.prefill_seconds = 0.0  # their share of the steps' forward passes
        # why KV may not move out of or into this engine's pool (tensor parallelism: rank 0's pool holds only its
        # KV heads), or None; checked by every call whose KV crosses the pool's edge
        self.kv_stays: str | None = None
        # tensor parallelism: ``install(request_id, blocks)`` copies the blocks whose KV arrived (rank 0's transfer
        # pool) into every rank's pool before the request joins the batch (tp/transfer.py), unless it arrived in
        # every rank's pool itself (the per-rank push: LLMEngine.kv_landed); None: the KV arrived in the pool itself
        self.install: Callable[[str, list[int]], None] | None = None
        # with a TBT bound: when each reservation was made, and the recent time from a reservation to its
        # add_prefilled (EWMA; 0.0: none seen yet): how far ahead ``_check_room`` looks
        self.reserved_at: dict[str, float] = {}
        self.join_lead_s = 0.0

    @property
    def prefill_counters(self) -> tuple[int, float]:
        """(prompt tokens computed for remote prefills, seconds: their share of the steps that computed them)."""
        return self.prefill_tokens, self.prefill_seconds

    # ---- prefill side ----------------------------------------------------------------------
    def add_remote(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                   on_layer: OnLayer | None = None, on_done: OnDone | None = None, priority: float = 0.0,
                   want: Want | None = None) -> None:
        """Queue a remote prefill (``remote_prefill.py``): scheduled as any prompt, in ``priority`` order; with
        ``want``, only once granted (``grant``): ``want()`` says the Scheduler would compute it now.
        Raises what ``add_request`` raises (bad input, a prompt that can never fit the pool)."""
        self._check_kv_moves(on_layer)
        seq = self.factory.make(request_id, prompt_token_ids, sampling)
        need = blocks_needed(len(seq.prompt_ids), self.block_manager.block_size)
        if need > self.block_manager.num_blocks:
            raise OutOfBlocksError(f"request {request_id!r} needs {need} KV blocks for its {len(seq.prompt_ids)} "
                                   f"prompt tokens but the pool has only {self.block_manager.num_blocks}")
        seq.remote, seq.priority = RemotePrefill(on_layer, on_done, want=want, granted=want is None), priority
        self.scheduler.add(seq)

    def grant(self, request_id: str) -> bool:
        """A remote prefill added with ``want`` may be computed now (its KV has somewhere to go). False when the
        request is not waiting here any more (aborted: nothing to do)."""
        seq = self.scheduler.seqs.get(request_id)
        if seq is None or seq.remote is None:
            return False
        seq.remote.granted = True
        return True

    def prefill_only(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                     on_layer: OnLayer | None = None) -> int:
        """Synchronously: one prompt's KV into local blocks taken now, its first token (``prefill_many``)."""
        cb = None if on_layer is None else _direct_as(on_layer, lambda layer, _rid, blocks, first: on_layer(layer,
                                                                                                      blocks, first))
        return self.prefill_many([(request_id, prompt_token_ids, sampling)], cb)[request_id]

    def prefill_many(
        self,
        requests: list[tuple[str, list[int], SamplingParams]],
        on_layer: Callable[[int, str, list[int], int], None] | None = None,
    ) -> dict[str, int]:
        """Synchronously (tests, profiling): several prompts as remote prefills whose blocks are taken now,
        stepped (with whatever else the engine runs) until each has its first token: request id -> first
        token. ``on_layer(layer, request_id, block_ids, first)`` as a remote prefill's. All or nothing:
        OutOfBlocksError when the blocks are not free now; on any error every block taken is freed."""
        self._check_kv_moves(on_layer)
        seqs: list[Sequence] = []
        firsts: dict[str, int] = {}
        errors: list[BaseException] = []
        try:
            for request_id, ids, sampling in requests:
                if any(s.request_id == request_id for s in seqs):
                    raise ValueError(f"request id {request_id!r} appears twice")
                seq = self.factory.make(request_id, ids, sampling)
                seq.block_table, seq.num_computed = self.block_manager.allocate(
                    seq.prompt_ids, len(seq.prompt_ids), use_prefix_cache=not seq.needs_prompt_logits)
                seq.num_cached_tokens = seq.num_computed
                seq.remote = RemotePrefill(_bind(on_layer, request_id), _collect(request_id, firsts, errors))
                seqs.append(seq)
        except BaseException:
            for seq in seqs:
                self.block_manager.free(seq.block_table)
            raise
        for seq in seqs:
            self.scheduler.join_running(seq)
        try:
            while len(firsts) < len(seqs) and not errors:
                self.other_outputs += self.step()
        finally:
            if errors or len(firsts) < len(seqs):
                for seq in seqs:
                    self.scheduler.remove(seq.request_id)
        if errors:
            raise errors[0]
        return firsts

    def remote_stepped(self, seq: Sequence, token: int | None, logprob) -> None:
        """After a step that computed a chunk of a remote prefill: its pushed blocks counted; the last
        chunk's first token reported and the request held; or, if its ``on_layer`` raised, it fails."""
        remote = seq.remote
        assert remote is not None
        if remote.error is not None:
            self.scheduler.remove(seq.request_id)
            remote.finish(None, remote.error)
            return
        remote.pushed = blocks_to_push(seq, self.block_manager.block_size)[1]
        seq.num_computed, seq.num_new = seq.chunk_end, 0
        self.scheduler.register_blocks(seq)
        if token is None:
            return  # more chunks to come
        seq.first_logprob = logprob
        self.scheduler.hold_prefilled(seq)
        remote.finish(token, None)

    def count_step(self, batch: list[Sequence], seconds: float) -> None:
        """The prefill counters: remote prompt tokens computed in a step, and their share of its time."""
        remote = sum(s.num_new for s in batch if s.remote is not None)
        if remote:
            self.prefill_tokens += remote
            self.prefill_seconds += seconds * remote / max(1, sum(max(s.num_new, 1) for s in batch))

    def prefill_block_ids(self, request_id: str) -> list[int]:
        """The blocks a prefill_only request holds (its prompt's KV)."""
        return list(self.scheduler.seqs[request_id].block_table)

    def prefill_logprob(self, request_id: str):
        """The first token's TokenLogprob of a held prefill_many request (None unless it asked)."""
        return self.scheduler.seqs[request_id].first_logprob

    def prefill_prompt_logprobs(self, request_id: str) -> list | None:
        """The prompt logprobs of a held prefill_many request (None unless it asked ``prompt_logprobs``):
        one entry per prompt token, None for the first."""
        return self.scheduler.seqs[request_id].prompt_logprobs

    def prefill_cached_tokens(self, request_id: str) -> int:
        """The prompt tokens of a held prefill_many request that its prefix cache held (not computed)."""
        return self.scheduler.seqs[request_id].num_cached_tokens

    def release(self, request_id: str) -> None:
        """Free the blocks of a prefill_only request (after its KV was sent). Unknown ids are ignored."""
        self.scheduler.release(request_id)

    # ---- decode side -----------------------------------------------------------------------
    def reserve(self, request_id: str, num_prompt_tokens: int, max_tokens: int) -> list[int]:
        """Blocks for prompt + max_tokens, taken now (see the module)."""
        return self._reserve(request_id, None, num_prompt_tokens, max_tokens)[0]

    def reserve_prefix(self, request_id: str, prompt_token_ids: list[int], max_tokens: int) -> tuple[list[int], int]:
        """``reserve`` reusing the prompt's longest cached prefix: (block ids, cached tokens)."""
        seq = self.factory.make(request_id, prompt_token_ids, _VALIDATE_ONLY, check_unique=False)
        return self._reserve(request_id, seq.prompt_ids, len(seq.prompt_ids), max_tokens)

    def _reserve(self, request_id: str, prompt_ids: list[int] | None, num_prompt_tokens: int,
                 max_tokens: int) -> tuple[list[int], int]:
        if self.scheduler.in_use(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if num_prompt_tokens < 1:
            raise ValueError(f"num_prompt_tokens must be >= 1, got {num_prompt_tokens}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if num_prompt_tokens + 1 > self.max_model_len:
            raise PromptTooLongError(num_prompt_tokens, self.max_model_len)
        self._check_room(request_id, num_prompt_tokens)
        n = min(num_prompt_tokens + max_tokens, self.max_model_len)
        table, cached = self.block_manager.allocate(prompt_ids or [], n, use_prefix_cache=prompt_ids is not None)
        held = tuple(prompt_ids[:cached]) if cached and prompt_ids is not None else ()  # (a hit needs the ids)
        self.scheduler.add_reservation(request_id, table, held)
        return list(table), cached

    def _check_room(self, request_id: str, num_prompt_tokens: int) -> None:
        """With a TBT bound (the scheduler's ``join_gate``): TbtBoundError unless the step predicted for when this
        request joins stays within it (``_rows_at_join``, plus this one). The reservation is then timed until its
        ``add_prefilled`` (``join_lead_s``)."""
        gate = self.scheduler.join_gate
        if gate is None:
            return
        rows, ctx = self._rows_at_join(gate, num_prompt_tokens)
        if not gate.admits(rows, ctx, num_prompt_tokens):
            raise TbtBoundError(f"request {request_id!r}: no room within the TBT bound of {1000 * gate.bound_s:g} ms "
                                f"now ({rows} requests will be running, waiting to join or have their KV on the way "
                                "when it would join)")
        self.reserved_at[request_id] = time.perf_counter()

    def _rows_at_join(self, gate: TbtBudget, num_prompt_tokens: int) -> tuple[int, int]:
        """(rows, context) the batch will hold when a request reserved now joins: every request waiting to join or
        reserved (a reservation's context counted as this prompt's: theirs are not kept), and each running one
        that will not have finished by then: its tokens left (``max_tokens``) times the step predicted now is more
        than the time reservations took to join lately (``join_lead_s``; unknown yet: every running one)."""
        s = self.scheduler
        rows = len(s.joining) + len(s.reserved)
        ctx = sum(q.num_tokens for q in s.joining) + len(s.reserved) * num_prompt_tokens
        running_ctx = sum(q.num_tokens for q in s.running)
        step = gate.model.predict(len(s.running), running_ctx) if s.running and self.join_lead_s else None
        for q in s.running:
            left = q.sampling.max_tokens - len(q.output_ids)
            if step is None or not math.isfinite(step) or left * step > self.join_lead_s:
                rows, ctx = rows + 1, ctx + q.num_tokens
        return rows, ctx

    def add_prefilled(
        self, request_id: str, prompt_token_ids: list[int], first_token_id: int, sampling: SamplingParams
    ) -> None:
        """Join a reserved request whose prompt KV is in its blocks to the running batch."""
        self._check_kv_moves(add_prefilled=True)
        table = self.scheduler.reservation(request_id)
        if self.install is not None and table is not None:  # the blocks after the cached prefix: the KV's, in
            bs = self.block_manager.block_size  # every rank's pool before the reservation is taken (a failure
            cached = len(self.scheduler.reserved_prefix.get(request_id, ()))  # leaves it to the caller's abort)
            self.install(request_id, table[cached // bs: blocks_needed(len(prompt_token_ids), bs)])
        seq = self._take_reserved(request_id, prompt_token_ids, sampling)
        self._joined(request_id)
        seq.num_computed = len(seq.prompt_ids)
        self.scheduler.register_blocks(seq)
        self.outputs.append_token(seq, first_token_id)
        seq.pending_ids.clear()  # prefill reported the first token (and its logprob)
        seq.pending_text = ""
        seq.pending_logprobs.clear()
        if seq.status is Status.FINISHED:
            self.scheduler.finish_early(seq)
        else:
            self.scheduler.join_prefilled(seq)  # at once, or as a TBT bound finds it room (step_budget.py)

    def _joined(self, request_id: str) -> None:
        """A reservation's KV is in: its time since ``reserve`` into ``join_lead_s`` (0.3 of the new one)."""
        at = self.reserved_at.pop(request_id, None)
        if at is not None:
            lead = time.perf_counter() - at
            self.join_lead_s = lead if not self.join_lead_s else 0.7 * self.join_lead_s + 0.3 * lead

    def _check_kv_moves(self, on_layer: object = None, add_prefilled: bool = False) -> None:
        """ValueError (``kv_stays``) when KV would be pushed out (an ``on_layer``) or was written in from outside."""
        if self.kv_stays is not None and (on_layer is not None or add_prefilled):
            raise ValueError(self.kv_stays)

    def prefill_reserved(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Join a reserved request to the running batch to compute its prompt's missing KV here."""
        seq = self._take_reserved(request_id, prompt_token_ids, sampling)
        self.reserved_at.pop(request_id, None)  # (its prompt is computed here: no KV lead to learn from)
        self.scheduler.join_running(seq)

    def _take_reserved(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> Sequence:
        """The reservation handed to a new sequence (its cached prefix counted as computed)."""
        table = self.scheduler.reservation(request_id)
        if table is None:
            raise ValueError(f"request {request_id!r} has no reservation (call reserve first)")
        seq = self.factory.make(request_id, prompt_token_ids, sampling, check_unique=False)
        if blocks_needed(len(seq.prompt_ids), self.block_manager.block_size) > len(table):
            raise ValueError(f"request {request_id!r} reserved {len(table)} blocks, too few for "
                             f"{len(seq.prompt_ids)} prompt tokens")
        prefix = self.scheduler.reserved_prefix.get(request_id, ())
        if tuple(seq.prompt_ids[: len(prefix)]) != prefix:
            raise ValueError(f"request {request_id!r}: the prompt does not start with the {len(prefix)} cached tokens "
                             "its reservation reused")
        seq.block_table, _ = self.scheduler.take_reservation(request_id)
        seq.reserved = True
        seq.num_computed = seq.num_cached_tokens = len(prefix)
        return seq


# reserve_prefix validates prompt ids through the SequenceFactory, which wants sampling params.
_VALIDATE_ONLY = SamplingParams(max_tokens=1)


def _bind(on_layer, request_id: str) -> OnLayer | None:
    """prefill_many's per-request ``on_layer``."""
    if on_layer is None:
        return None
    return _direct_as(on_layer, lambda layer, blocks, first: on_layer(layer, request_id, blocks, first))


def _direct_as(on_layer, wrapper):
    """``wrapper`` with ``on_layer``'s ``kv_direct`` (its KV leaves from every rank's own pool: remote_prefill.py)."""
    if getattr(on_layer, "kv_direct", False):
        wrapper.kv_direct = True
    return wrapper


def _collect(request_id: str, firsts: dict[str, int], errors: list[BaseException]) -> OnDone:
    """prefill_many's per-request ``on_done``: the first token, or the error."""
    def on_done(token: int | None, error: BaseException | None) -> None:
        if error is not None:
            errors.append(error)
        elif token is not None:
            firsts[request_id] = token
    return on_done
