"""EngineCore: what every engine over the one Scheduler shares: admission (``add_request``), ``step``,
``abort``, the P/D primitives (``pd``) and the reads; the subclass supplies the runner that computes a step.

Two subclasses: ``llm_engine.LLMEngine`` (a model over a paged KV tensor: ``ModelRunner``) and
``sim/engine.SimEngine`` (a profile's modelled time: ``sim/runner.SimRunner``). A runner has one call,
``forward_sample(batch, on_layer) -> (tokens, logprobs, prompt_logprobs)``, one entry per sequence of the
batch (``model_runner.py`` says what each means); ``on_layer(layer)`` (or None) is called after each
layer's KV of the step is written (``remote_prefill.layer_callback``).

Built here: the BlockManager, the Scheduler, the OutputProcessor, the SequenceFactory and PDHooks;
``tiers`` (evicted prefix-cache blocks: ``kv_tiers.py``) is None unless the subclass sets it.
Not thread-safe: call from one thread (AsyncLLMEngine runs it on its own thread).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

from .block_manager import BlockManager, blocks_needed
from .engine_config import EngineConfig
from .errors import OutOfBlocksError
from .outputs import OutputProcessor, take_output
from .pd_hooks import PDHooks
from .remote_prefill import PrefillAborted, layer_callback
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import RequestOutput, Sequence, SequenceFactory, Status
from .step_budget import StepShape, StepTimeModel, TbtBudget, shape_of

if TYPE_CHECKING:
    from .kv_tiers import KVTiers, TierStats


class EngineCore:
    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int, runner: Any, *, vocab_size: int,
                 eos_ids: set[int], detokenizer: Callable[[], Any], grammars=None):
        """``runner``: the step's computation (module docstring); ``detokenizer()``: a fresh incremental
        detokenizer (a tokenizer's); ``grammars``: constrained decoding (``grammar.Grammars``) or None."""
        self.config, self.max_model_len, self.block_size = config, max_model_len, config.block_size
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_cache)
        self.tiers: KVTiers | None = None
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.long_prefill_threshold, solo_prompt_tokens=config.solo_prompt_tokens)
        self.stalled = False  # the last step had work waiting but could schedule none of it (no free blocks)
        self.runner = runner
        self.outputs = OutputProcessor(eos_ids, max_model_len)
        self.factory = SequenceFactory(vocab_size, max_model_len, detokenizer, config.detokenize,
                                       self.scheduler.in_use, grammars)
        # the P/D primitives, called as engine.pd.reserve(...) etc. (pd_hooks.py)
        self.pd = PDHooks(self.scheduler, self.factory, self.outputs, max_model_len, self.step)
        # the TBT bound's gate over a model of this engine's own decode steps (step_budget.py), or None
        self.step_model: StepTimeModel | None = None
        if config.tbt_slo_ms:
            self.step_model = StepTimeModel()
            self.scheduler.join_gate = TbtBudget(config.tbt_slo_ms / 1000.0, self.step_model)
        self.last_shape: StepShape | None = None  # the last step's batch (kept for a step trace or a step model)
        self._last_end = 0.0  # when that step ended (perf_counter)
        self.keep_shapes = bool(config.step_trace) or self.step_model is not None

    # ---- public queries --------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks()

    def prefix_hit_tokens(self) -> int:
        """Prompt tokens reused from the prefix cache since start (a counter)."""
        return self.block_manager.prefix_hits * self.block_manager.block_size

    def tier_stats(self) -> dict[str, TierStats]:
        """Tier name ("host", "disk") -> a copy of its running totals; empty without tiers."""
        return {} if self.tiers is None else {n: replace(t) for n, t in self.tiers.stats().items()}

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def num_requests(self) -> int:
        """Requests holding engine state: waiting, running, prefilled-and-held, or reserved."""
        return self.scheduler.num_requests()

    def request_ids(self) -> list[str]:
        """Ids of every request holding engine state (waiting, running, held, or reserved)."""
        return self.scheduler.request_ids()

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def num_preemptions(self) -> int:
        """Colocated sequences freed and recomputed for lack of blocks."""
        return self.scheduler.num_preemptions

    @property
    def eos_ids(self) -> set[int]:
        """Token ids that end a request (unless ``ignore_eos``): the tokenizer's and the config's."""
        return self.outputs.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: set[int]) -> None:
        self.outputs.eos_ids = ids

    # ---- colocated path --------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Queue a request. Raises PromptTooLongError, OutOfBlocksError (can never fit), ValueError."""
        seq = self.factory.make(request_id, prompt_token_ids, sampling)
        need = blocks_needed(min(len(seq.prompt_ids) + sampling.max_tokens, self.max_model_len), self.block_size)
        if need > self.num_blocks:
            raise OutOfBlocksError(
                f"request {request_id!r} needs {need} KV blocks ({len(seq.prompt_ids)} prompt tokens + "
                f"max_tokens {sampling.max_tokens}) but the pool has only {self.num_blocks}"
            )
        self.scheduler.add(seq)

    def abort(self, request_id: str, error: str = "aborted") -> bool:
        """Forget a request wherever it is and free its blocks. False if unknown. A remote prefill not yet
        prefilled hears ``error`` (``PrefillAborted``)."""
        seq = self.scheduler.seqs.get(request_id)
        found = self.scheduler.remove(request_id)
        self.pd.reserved_at.pop(request_id, None)
        if seq is not None and seq.remote is not None:
            seq.remote.finish(None, PrefillAborted(f"request {request_id!r}: {error}"))
        return found

    def abort_all(self) -> None:
        """Abort every request holding engine state (waiting, running, held, reserved)."""
        for request_id in self.request_ids():
            self.abort(request_id, "the engine stopped")

    def fail_scheduled(self, error: str) -> list[RequestOutput]:
        """Abort every waiting or running request after a failed step; one finished
        RequestOutput each (finish_reason "abort", ``error`` set; a remote prefill hears it through its
        ``on_done``). Held and reserved requests stay."""
        failed = list(self.scheduler.running) + list(self.scheduler.waiting)
        for seq in failed:
            self.abort(seq.request_id, error)
        return [RequestOutput(seq.request_id, [], True, "abort", error=error) for seq in failed if seq.remote is None]

    def step(self) -> list[RequestOutput]:
        """One scheduled forward pass (prefill chunks and decode rows) and what it produced."""
        outputs = self.pd.other_outputs + [take_output(seq) for seq in self.scheduler.take_done_early()]
        self.pd.other_outputs = []
        batch = self.scheduler.schedule()
        self.stalled = not batch and self.scheduler.has_unfinished() and not outputs
        if not batch:
            self.last_shape = None
            return outputs
        started = time.perf_counter()
        shape = shape_of(batch) if self.keep_shapes else None
        self._run(batch)
        for seq in batch:
            if seq.remote is not None:
                continue  # finished (held) or failed in _run; its caller hears on_done
            if seq.status is Status.FINISHED:
                self.scheduler.finish(seq)
                outputs.append(take_output(seq))
            elif seq.pending_ids or seq.pending_text:
                outputs.append(take_output(seq))
        if shape is not None:
            self._observe(shape, started)
        return outputs

    def _observe(self, shape: StepShape, started: float) -> None:
        """Keep the step's shape; a pure decode step teaches the TBT bound's model the time between tokens of its
        requests: from the end of the step before when one of them was in it too (the calls and the outputs'
        delivery in between count), else from this step's start."""
        end = time.perf_counter()
        if self.step_model is not None and not shape.chunk_tokens:
            last = self.last_shape
            begun = self._last_end if last is not None and shape.ids & last.ids else started
            self.step_model.observe(shape.rows, shape.ctx_tokens, end - begun)
        self.last_shape, self._last_end = shape, end

    def _run(self, batch: list[Sequence]) -> None:
        """The step's forward pass; each sequence's chunk counted as computed, its token appended (or, for
        a remote prefill, its KV handed on and its first token reported: ``pd_hooks.py``)."""
        started = time.perf_counter()
        tokens, logprobs, prompt_lps = self.runner.forward_sample(batch, layer_callback(batch, self.block_size))
        self.pd.count_step(batch, time.perf_counter() - started)
        for seq, token, logprob, prompt_lp in zip(batch, tokens, logprobs, prompt_lps):
            if prompt_lp is not None:
                seq.prompt_logprobs = (seq.prompt_logprobs or []) + prompt_lp
            if seq.remote is not None:
                self.pd.remote_stepped(seq, token, logprob)
                continue
            seq.num_computed, seq.num_new = seq.chunk_end, 0
            self.scheduler.register_blocks(seq)
            if token is not None:  # None: a chunk before the prompt's last
                self.outputs.append_token(seq, token, logprob)
