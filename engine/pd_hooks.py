"""PDHooks: the engine's prefill/decode disaggregation primitives, on each side.

An LLMEngine builds one and holds it as ``engine.pd``; these methods are the implementation
(LLMEngine does not repeat them). Call them on the thread that steps the engine: AsyncLLMEngine
runs them on its engine thread, kvpool and the synchronous tests call them directly. A
request's blocks are freed by ``LLMEngine.abort`` too, wherever it is.

Prefill side (the prompt's KV is computed here and sent elsewhere):
- ``prefill_many`` (and ``prefill_only`` for one prompt) computes prompts' KV into local
  blocks in ONE forward pass, calling ``on_layer(layer_idx, {request_id: block_ids})`` on this
  thread right after each layer's KV is written, and returns each first token (a request
  with ``prompt_logprobs`` computes its whole prompt, no prefix hit, and keeps the prompt's
  logprobs for ``prefill_prompt_logprobs``). All or nothing: on any error (bad input, blocks
  not free now, ``on_layer`` raising) every block taken is freed before the error propagates.
- Who frees: the caller, with ``release(request_id)`` once the KV is sent (or ``abort``).
- ``prefill_counters``: (``prefill_tokens``, ``prefill_seconds``): prompt tokens computed by
  ``prefill_many`` (prefix hits excluded) and the seconds its forward passes took, summed (the
  measured throughput).

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

import time
from typing import Callable

from .block_manager import blocks_needed
from .errors import PromptTooLongError
from .model_runner import ModelRunner
from .outputs import OutputProcessor
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence, SequenceFactory, Status


class PDHooks:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, factory: SequenceFactory,
                 outputs: OutputProcessor, max_model_len: int):
        self.scheduler, self.runner, self.factory, self.outputs = scheduler, runner, factory, outputs
        self.block_manager = scheduler.block_manager
        self.max_model_len = max_model_len
        self.prefill_tokens = 0  # prompt tokens computed by prefill_many (prefix hits excluded)
        self.prefill_seconds = 0.0  # time its forward passes took

    @property
    def prefill_counters(self) -> tuple[int, float]:
        """(prompt tokens computed by prefill_only/prefill_many, seconds their forward passes took)."""
        return self.prefill_tokens, self.prefill_seconds

    # ---- prefill side ----------------------------------------------------------------------
    def prefill_only(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        on_layer: Callable[[int, list[int]], None] | None = None,
    ) -> int:
        """Compute one prompt's KV into local blocks and return the first generated token.

        ``on_layer(layer_idx, block_ids)`` is called on this thread right after each layer's
        KV is written; ``block_ids`` are all the prompt's blocks (prefix-cache hits included).
        The blocks stay held until ``release(request_id)``. Raises OutOfBlocksError when the
        prompt's blocks are not free now, PromptTooLongError, ValueError. On any error
        (including one raised by ``on_layer``) the blocks are freed before it propagates.
        """
        cb = None if on_layer is None else (lambda layer, tables: on_layer(layer, tables[request_id]))
        return self.prefill_many([(request_id, prompt_token_ids, sampling)], cb)[request_id]

    def prefill_many(
        self,
        requests: list[tuple[str, list[int], SamplingParams]],
        on_layer: Callable[[int, dict[str, list[int]]], None] | None = None,
    ) -> dict[str, int]:
        """Several prompts' KV in one forward pass: request id -> first token (see the module)."""
        seqs: list[Sequence] = []
        try:
            for request_id, ids, sampling in requests:
                if any(s.request_id == request_id for s in seqs):
                    raise ValueError(f"request id {request_id!r} appears twice")
                seq = self.factory.make(request_id, ids, sampling)
                seq.block_table, seq.num_computed = self.block_manager.allocate(
                    seq.prompt_ids, len(seq.prompt_ids), use_prefix_cache=not seq.needs_prompt_logits)
                seq.num_cached_tokens = seq.num_computed
                seqs.append(seq)
            layer_cb = None
            if on_layer is not None:
                tables = {s.request_id: list(s.block_table) for s in seqs}
                layer_cb = lambda i: on_layer(i, tables)  # noqa: E731
            started = time.perf_counter()
            tokens, logprobs, prompt_lps = self.runner.forward_sample(seqs, layer_cb) if seqs else ([], [], [])
            self.prefill_seconds += time.perf_counter() - started
            self.prefill_tokens += sum(len(s.prompt_ids) - s.num_computed for s in seqs)
        except BaseException:
            for seq in seqs:
                self.block_manager.free(seq.block_table)
            raise
        for seq, logprob, prompt_lp in zip(seqs, logprobs, prompt_lps):
            seq.first_logprob, seq.prompt_logprobs = logprob, prompt_lp
            seq.num_computed = len(seq.prompt_ids)
            seq.status = Status.RUNNING
            self.scheduler.hold(seq)
            self.scheduler.register_blocks(seq)
        return {s.request_id: t for s, t in zip(seqs, tokens)}

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
        n = min(num_prompt_tokens + max_tokens, self.max_model_len)
        table, cached = self.block_manager.allocate(prompt_ids or [], n, use_prefix_cache=prompt_ids is not None)
        held = tuple(prompt_ids[:cached]) if cached and prompt_ids is not None else ()  # (a hit needs the ids)
        self.scheduler.add_reservation(request_id, table, held)
        return list(table), cached

    def add_prefilled(
        self, request_id: str, prompt_token_ids: list[int], first_token_id: int, sampling: SamplingParams
    ) -> None:
        """Join a reserved request whose prompt KV is in its blocks to the running batch."""
        seq = self._take_reserved(request_id, prompt_token_ids, sampling)
        seq.num_computed = len(seq.prompt_ids)
        self.scheduler.register_blocks(seq)
        self.outputs.append_token(seq, first_token_id)
        seq.pending_ids.clear()  # prefill reported the first token (and its logprob)
        seq.pending_text = ""
        seq.pending_logprobs.clear()
        if seq.status is Status.FINISHED:
            self.scheduler.finish_early(seq)
        else:
            self.scheduler.join_running(seq)

    def prefill_reserved(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Join a reserved request to the running batch to compute its prompt's missing KV here."""
        seq = self._take_reserved(request_id, prompt_token_ids, sampling)
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
