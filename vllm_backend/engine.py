"""VllmAsyncEngine: vLLM's engine (in-process, one CPU worker) behind the calls pdserve's
servers make of an engine (``pdserve/engine/server_engine.py: ServerEngine``, which the built-in
``AsyncLLMEngine`` implements too), so the Session, picker, router and SLO code run unchanged
over it.

Every vLLM call runs on one engine thread (vllm_thread.py); coroutines submit work through
a queue and get results through asyncio futures/queues (as AsyncLLMEngine). The thread steps
vLLM while it has requests (or held blocks to report freed) and sleeps on the queue otherwise.

How each P/D call maps onto vLLM (``connector.py`` holds the hooks, ``bridge.py`` the state):
- ``prefill_only``: a request with max_tokens 1 whose prompt KV the worker hands, layer by
  layer, to ``on_layer`` (the CacheStore pushes it); returns the first token. vLLM keeps the
  blocks after the request finished until ``release``.
- ``reserve``: a request whose prompt is ``num_prompt_tokens`` placeholders + 1 (the slot of
  the prefill's first token), every prompt token reported remote: vLLM's scheduler allocates
  the blocks (WAITING_FOR_REMOTE_KVS) and they come back as the reservation.
- ``reserve_prefix``: the same with the real prompt + 1 placeholder, and the request's block
  hashes cut to the prompt's full blocks before its last token (the built-in engine's limit):
  vLLM's prefix cache matches those, and only the prompt past the hit is reported remote;
  returns (blocks, cached tokens). ``reserve`` keeps no hashes, so placeholders never match.
- ``add_prefilled``: the real prompt + first token and sampling are written into the waiting
  request, its block hashes are recomputed from them (before vLLM caches its blocks), the
  load is reported done, and vLLM computes the first token's KV and decodes: the outputs
  start after the first token, as with the built-in engine.
- ``prefill_reserved``: the placeholder is dropped and the prompt computed here (a fresh request).
- ``abort`` / an output stream left early: vLLM aborts the request and frees its blocks.

Logprobs (``logprobs``, ``prompt_logprobs``) are vLLM's raw ones, in the built-in engine's
shape (``logprobs.py``): prefill_only asks them of its request and keeps the first token's
(``prefill_logprob``) and the prompt's (``prefill_prompt_logprobs``) until ``release``;
``add_prefilled`` asks them of the waiting request (its output processor's LogprobsProcessor,
made for the placeholder sampling, is rebuilt), whose outputs carry one per later token.

Constrained output (``grammar``: response_format, tools) is vLLM's structured outputs (xgrammar,
compact JSON as the built-in engine): the prefill's request carries it, so its first token obeys
it; the decode's request, added at ``reserve`` before its sampling is known, gets it at
``add_prefilled`` (compiled then, and told the first token, plus the prompt tokens a resume fed
back: ``GrammarSpec.feed``), before vLLM schedules it; vLLM advances it by every later token.
Stop strings are not given to vLLM: the prefill's TextStream cuts the text at one and ends the
request (which aborts it here). Prefix caches: both servers' are vLLM's, and their events
reach routers and decode pickers re-hashed as pdserve hashes prompts (``kv_events.py``,
``publish_kv_events``); ``prefix_hit_tokens`` counts the prompt tokens vLLM found cached (prefill:
computed from cache; decode: not received). Not carried over: KV tiers and swap; vLLM may preempt a
decode request when its blocks run out (it then recomputes it; the built-in engine reserves
prompt + max_tokens up front instead).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future, wait
from types import SimpleNamespace
from typing import AsyncIterator, Callable

from pdserve.engine.block_manager import blocks_needed, reusable_blocks
from pdserve.engine.busy_clock import BusyClock
from pdserve.engine.engine_thread import set_exception, set_result
from pdserve.engine.errors import OutOfBlocksError, PromptTooLongError
from pdserve.engine.sequence import RequestOutput

from .bridge import Bridge
from .grants import Grants
from .vllm_thread import VllmEngineThread
from .logprobs import prompt_logprobs, sample_logprobs

log = logging.getLogger(__name__)
RESERVE_TIMEOUT_S = 10.0  # vLLM's scheduler allocates a reservation within a step or two
GRAMMAR_COMPILE_TIMEOUT_S = 30.0  # a JSON schema compiles in milliseconds to a second here


def _structured_outputs(grammar):
    """pdserve's GrammarSpec (engine/grammar.py) as vLLM's StructuredOutputsParams (None: no grammar)."""
    if grammar is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if grammar.kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(json=grammar.schema)


def _fed(ids: list[int], grammar) -> list[int]:
    """The trailing prompt tokens already produced under ``grammar`` (a resume's ``feed``; none without one)."""
    return list(ids[len(ids) - grammar.feed:]) if grammar is not None and grammar.feed else []


class VllmAsyncEngine(VllmEngineThread):
    def __init__(self, llm, bridge: Bridge, *, max_model_len: int, eos_token_ids: tuple[int, ...]):
        super().__init__()
        self.llm = llm  # vllm.v1.engine.llm_engine.LLMEngine, in-process
        core = llm.engine_core.engine_core
        self._scheduler = core.scheduler
        self._structured = core.structured_output_manager
        self.bridge = bridge
        self.block_size = bridge.block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.num_blocks = self._pool().get_num_free_blocks()  # vLLM's null block is not ours
        self._counters = (0, 0.0)  # prompt tokens computed by prefill_only, seconds
        self._busy_clock = BusyClock()  # seconds in vLLM's steps (this thread's: they never overlap)
        self._started_at: dict[str, tuple[float, int]] = {}
        self._num_requests = 0
        # prefill_only requests that asked: the first token's TokenLogprob, the prompt's logprobs (until release)
        self._first_logprobs: dict[str, object] = {}
        self._prompt_logprobs: dict[str, list] = {}
        self._prefill_cached: dict[str, int] = {}  # prefill_only requests held: prompt tokens the prefix cache held
        self._grants = Grants()  # prefill_only requests given ``want``, until granted
        self._ks: dict[str, tuple[int | None, int | None]] = {}  # requests that asked: (logprobs, prompt_logprobs)
        # prompt tokens vLLM's prefix cache held (prefill_only: not computed; reserve: not received)
        self._hit_tokens = 0
        self.kv_events = None  # VllmKvEvents once publish_kv_events ran

    def publish_kv_events(self, listener) -> None:
        """vLLM's prefix-cache events go to ``listener`` (a KvEventPublisher) as pdserve block hashes;
        call before the engine thread starts. The engine must be built with KV-cache events on
        (server.py does)."""
        from .kv_events import VllmKvEvents

        self.kv_events = VllmKvEvents(listener, self.block_size)
        self._scheduler.kv_event_publisher = self.kv_events

    # ---- reads from any thread ----
    def _pool(self):
        return self._scheduler.kv_cache_manager.block_pool

    def num_free_blocks(self) -> int:
        return self._pool().get_num_free_blocks()

    def num_requests(self) -> int:
        return self._num_requests

    def prefix_hit_tokens(self) -> int:
        return self._hit_tokens

    def tier_stats(self) -> dict:
        return {}

    def prefill_counters(self) -> tuple[int, float]:
        return self._counters

    def swapped(self) -> tuple[int, int]:
        return 0, 0

    def busy_seconds(self) -> float:
        return self._busy_clock.seconds()

    async def stats(self) -> dict:
        return {"num_free_blocks": self.num_free_blocks(), "num_blocks": self.num_blocks,
                "num_requests": self.num_requests(), "engine": "vllm"}

    # ---- colocated ----
    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling) -> AsyncIterator[RequestOutput]:
        async for out in self._stream(request_id, self._add, request_id, list(prompt_token_ids), sampling):
            yield out

    async def abort(self, request_id: str) -> bool:
        return await self._call(self._abort, request_id)

    # ---- prefill side ----
    async def prefill_only(self, request_id: str, prompt_token_ids: list[int], sampling,
                           on_layer: Callable[[int, list[int], int], None] | None = None,
                           want: Callable[[], None] | None = None) -> int:
        """The prompt's KV through the connector, layer by layer (``on_layer(layer, block_ids, 0)``: every
        block of the prompt each time); its first token. With ``want``: held until ``grant`` (grants.py)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if want is not None:
            await self._grants.wait(request_id, want)
        await self._call(self._add_prefill, request_id, list(prompt_token_ids), sampling, on_layer, (loop, fut))
        return await fut

    async def prefill_logprob(self, request_id: str):
        """The first token's TokenLogprob of a prefill_only request still held (None unless it asked)."""
        return self._first_logprobs.get(request_id)

    async def prefill_prompt_logprobs(self, request_id: str) -> list | None:
        """The prompt logprobs of a prefill_only request still held (None unless it asked ``prompt_logprobs``)."""
        return self._prompt_logprobs.get(request_id)

    def prefill_cached_tokens(self, request_id: str) -> int:
        """The prompt tokens of a prefill_only request still held that vLLM's prefix cache held (not computed)."""
        return self._prefill_cached.get(request_id, 0)

    async def grant(self, request_id: str) -> bool:
        return self._grants.grant(request_id)

    async def release(self, request_id: str) -> None:
        await self._call(self._release, request_id)

    # ---- decode side ----
    async def reserve(self, request_id: str, num_prompt_tokens: int, max_tokens: int) -> list[int]:
        block_ids, _ = await self._reserved(request_id, None, num_prompt_tokens, max_tokens)
        return block_ids

    async def reserve_prefix(self, request_id: str, prompt_token_ids: list[int], max_tokens: int):
        return await self._reserved(request_id, list(prompt_token_ids), len(prompt_token_ids), max_tokens)

    async def _reserved(self, request_id: str, prompt: list[int] | None, num_prompt_tokens: int,
                        max_tokens: int) -> tuple[list[int], int]:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        await self._call(self._reserve, request_id, prompt, num_prompt_tokens, max_tokens, (loop, fut))
        try:
            async with asyncio.timeout(RESERVE_TIMEOUT_S):
                return await asyncio.shield(fut)
        except asyncio.TimeoutError:
            await self.abort(request_id)
            raise OutOfBlocksError(f"vLLM did not allocate {num_prompt_tokens} prompt tokens within "
                                   f"{RESERVE_TIMEOUT_S:.0f} s") from None

    async def add_prefilled(self, request_id: str, prompt_token_ids: list[int], first_token_id: int,
                            sampling) -> AsyncIterator[RequestOutput]:
        async for out in self._stream(request_id, self._add_prefilled, request_id, list(prompt_token_ids),
                                      first_token_id, sampling):
            yield out

    async def prefill_reserved(self, request_id: str, prompt_token_ids: list[int],
                               sampling) -> AsyncIterator[RequestOutput]:
        await self._call(self._drop_reservation, request_id)
        async for out in self.generate(request_id, prompt_token_ids, sampling):
            yield out

    # ---- engine thread ----
    def _vllm_sampling(self, sp, *, max_tokens: int | None = None, kv: dict | None = None, prefill: bool = False):
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        return VSP(max_tokens=max_tokens if max_tokens is not None else sp.max_tokens, temperature=sp.temperature,
                   top_p=sp.top_p, top_k=sp.top_k if sp.top_k > 0 else 0, seed=sp.seed,
                   stop=None,  # stop strings: the prefill's TextStream cuts the text and ends the request
                   stop_token_ids=None if prefill else list(sp.stop_token_ids),
                   ignore_eos=True if prefill else sp.ignore_eos, detokenize=False, logprobs=sp.logprobs,
                   prompt_logprobs=getattr(sp, "prompt_logprobs", None),
                   output_kind=RequestOutputKind.DELTA, extra_args={"kv_transfer_params": kv} if kv else None,
                   structured_outputs=_structured_outputs(getattr(sp, "grammar", None)))

    def _add_fed(self, rid: str, ids: list[int], vsp, grammar) -> None:
        """llm.add_request, then (a resumed request: ``grammar.feed`` > 0) the grammar told the trailing
        prompt tokens it already produced, before vLLM samples the request's first token."""
        fed = _fed(ids, grammar)
        req = self._add_request(rid, ids, vsp)
        if fed:
            try:
                self._advance_grammar(req, fed)
            except BaseException:
                self.llm.abort_request([rid])
                raise

    def _add_request(self, rid: str, ids: list[int], vsp):
        """llm.add_request; returns the scheduler's vLLM Request (its id is ours plus a random suffix)."""
        known = set(self._scheduler.requests)
        self.llm.add_request(rid, {"prompt_token_ids": ids}, vsp)
        (internal_id,) = set(self._scheduler.requests) - known
        return self._scheduler.requests[internal_id]

    def _advance_grammar(self, req, tokens: list[int]) -> None:
        """Wait for the request's grammar to compile and make it accept ``tokens`` (already produced
        under it: on the prefill, the part of the prompt a resume fed back; on the decode, that and the
        prefill's first token). vLLM's scheduler advances it by each token sampled after these."""
        pending = req.structured_output_request._grammar
        if isinstance(pending, Future):
            wait([pending], timeout=GRAMMAR_COMPILE_TIMEOUT_S)
        grammar = req.structured_output_request.grammar
        if grammar is None or isinstance(grammar, Exception):
            raise ValueError(f"response_format: vLLM could not compile the grammar: {grammar or 'timed out'}")
        if tokens and not grammar.accept_tokens(req.request_id, tokens):
            raise ValueError(f"response_format: the grammar refuses the tokens already produced ({tokens[-8:]}, ...)")

    def _check_len(self, n_prompt: int) -> None:
        if n_prompt < 1:
            raise ValueError("the prompt is empty")
        if n_prompt + 1 > self.max_model_len:
            raise PromptTooLongError(n_prompt, self.max_model_len)

    def _check_free(self, tokens: int) -> None:
        need, free = blocks_needed(tokens, self.block_size), self.num_free_blocks()
        if need > free:
            raise OutOfBlocksError(f"needs {need} KV blocks, {free} free")

    def _add(self, rid: str, ids: list[int], sampling) -> None:
        self._check_len(len(ids))
        self._add_fed(rid, ids, self._vllm_sampling(sampling), getattr(sampling, "grammar", None))
        self._ask(rid, sampling)

    def _add_prefill(self, rid: str, ids: list[int], sampling, on_layer, reply) -> None:
        self._check_len(len(ids))
        self._check_free(len(ids) + 1)
        vsp = self._vllm_sampling(sampling, max_tokens=1, kv={"pdserve": "prefill", "rid": rid}, prefill=True)
        self.bridge.start_prefill(rid, on_layer)
        try:
            self._add_fed(rid, ids, vsp, getattr(sampling, "grammar", None))
        except BaseException:
            self.bridge.forget(rid)
            raise
        self._firsts[rid] = reply
        self._started_at[rid] = (time.perf_counter(), len(ids))
        self._ask(rid, sampling)

    def _reserve(self, rid: str, prompt: list[int] | None, n_prompt: int, max_tokens: int, reply) -> None:
        self._check_len(n_prompt)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self._check_free(n_prompt + 1)
        loop, fut = reply

        def on_blocks(ids: list[int], cached: int) -> None:
            self._hit_tokens += cached
            loop.call_soon_threadsafe(set_result, fut, (list(ids), cached))

        self.bridge.start_decode(rid, n_prompt, on_blocks)
        vsp = self._vllm_sampling(_Greedy(max(1, min(max_tokens - 1, self.max_model_len - n_prompt - 1))),
                                  kv={"pdserve": "decode", "rid": rid})
        try:
            req = self._add_request(rid, (prompt or [0] * n_prompt) + [0], vsp)
        except BaseException:
            self.bridge.forget(rid)
            raise
        # vLLM looks the prompt up by these hashes at its next step: only full blocks of real tokens
        # before the prompt's last one (a reservation without a prompt: none). add_prefilled recomputes
        # the rest once the tokens are real.
        del req.block_hashes[reusable_blocks(n_prompt, self.block_size) if prompt else 0:]

    def _add_prefilled(self, rid: str, ids: list[int], first: int, sampling) -> None:
        d = self.bridge.decodes.get(rid)
        if d is None or d.block_ids is None:
            raise ValueError(f"request {rid!r} has no reservation (call reserve first)")
        if len(ids) != d.num_prompt_tokens:
            raise ValueError(f"request {rid!r} reserved {d.num_prompt_tokens} prompt tokens, got {len(ids)}")
        stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(self.eos_token_ids))
        if sampling.max_tokens <= 1 or first in stops:  # the first token already ends it
            self._abort(rid)
            reason = "stop" if first in stops else "length"
            self._deliver(RequestOutput(rid, [], finished=True, finish_reason=reason, num_prompt_tokens=len(ids),
                                        logprobs=None if sampling.logprobs is None else []))
            return
        req = self._scheduler.requests[d.internal_id]
        tokens = list(ids) + [first]
        req.prompt_token_ids[:] = tokens
        req._all_token_ids[:] = tokens
        req.update_block_hashes()  # the blocks after the kept hashes, from the real tokens (before vLLM caches them)
        fresh = self._vllm_sampling(sampling, max_tokens=sampling.max_tokens - 1)
        vsp = req.sampling_params  # shared with vLLM's output processor (in-process): update in place
        for name in ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens",
                     "logprobs"):
            setattr(vsp, name, getattr(fresh, name))
        vsp._all_stop_token_ids = set(vsp._all_stop_token_ids) | set(fresh.stop_token_ids or ())
        if not sampling.ignore_eos and self.eos_token_ids:  # the placeholder ignored EOS: end on it now, as
            vsp._eos_token_id = self.eos_token_ids[0]       # vLLM's input processor would have set it up
            vsp.stop_token_ids = list(dict.fromkeys([*(vsp.stop_token_ids or ()), *self.eos_token_ids[1:]]))
            vsp._all_stop_token_ids |= set(self.eos_token_ids)
        req.max_tokens = vsp.max_tokens
        if vsp.logprobs is not None:  # the output processor made its LogprobsProcessor from the placeholder's
            self._ask_logprobs(d.internal_id, vsp)
            self._ks[rid] = (vsp.logprobs, None)
        if fresh.structured_outputs is not None:  # the grammar starts here, past what prefill produced under it
            try:
                self._start_grammar(req, fresh.structured_outputs, _fed(ids, sampling.grammar) + [first])
            except BaseException:
                self._abort(rid)  # the reservation's blocks go back
                raise
        self.bridge.loaded(rid)

    def _start_grammar(self, req, params, produced: list[int]) -> None:
        """Give the waiting decode request (added at reserve, before its sampling was known) the grammar
        vLLM would have built had the request come with it, advanced past ``produced``."""
        from vllm.v1.structured_output.request import StructuredOutputRequest

        params._backend = "xgrammar"  # what vLLM's input processor sets on a request it validates
        req.sampling_params.structured_outputs = params
        req.structured_output_request = StructuredOutputRequest.from_sampling_params(req.sampling_params)
        self._structured.grammar_init(req)
        self._advance_grammar(req, produced)

    def _ask_logprobs(self, internal_id: str, vsp) -> None:
        from vllm.v1.engine.logprobs import LogprobsProcessor

        state = self.llm.output_processor.request_states.get(internal_id)
        if state is None:
            raise RuntimeError(f"vLLM's output processor does not know request {internal_id!r}")
        state.logprobs_processor = LogprobsProcessor.from_new_request(None, SimpleNamespace(sampling_params=vsp))

    def _release(self, rid: str) -> None:
        self._ks.pop(rid, None)
        self._first_logprobs.pop(rid, None)
        self._prompt_logprobs.pop(rid, None)
        self._prefill_cached.pop(rid, None)
        self.bridge.release(rid)

    def _drop_reservation(self, rid: str) -> None:
        self._ks.pop(rid, None)
        self.llm.abort_request([rid])
        self.bridge.forget(rid)

    def _abort(self, rid: str) -> bool:
        known = (rid in self.bridge.prefills or rid in self.bridge.decodes or rid in self._streams
                 or rid in self._firsts)
        self._ks.pop(rid, None)
        self.llm.abort_request([rid])
        p = self.bridge.prefills.get(rid)
        if p is not None and p.held:
            self._release(rid)  # vLLM frees held blocks through get_finished
        else:
            self.bridge.forget(rid)
        reply = self._firsts.pop(rid, None)
        if reply is not None:
            reply[0].call_soon_threadsafe(set_exception, reply[1], RuntimeError(f"request {rid!r} was aborted"))
        return known

    def _abort_all(self) -> None:
        for rid in set(self._streams) | set(self._firsts) | set(self.bridge.prefills) | set(self.bridge.decodes):
            self._abort(rid)

    def _on_output(self, out) -> None:
        rid = out.request_id
        comp = out.outputs[0] if out.outputs else None
        tokens = list(comp.token_ids) if comp is not None else []
        if rid in self._firsts:
            if not out.finished:
                return
            loop, fut = self._firsts.pop(rid)
            started, n = self._started_at.pop(rid, (time.perf_counter(), 0))
            cached = out.num_cached_tokens or 0  # prompt tokens vLLM's prefix cache held: not computed
            tokens_done, seconds = self._counters
            self._counters = (tokens_done + n - cached, seconds + time.perf_counter() - started)
            self._hit_tokens += cached
            error = self.bridge.prefill_errors.pop(rid, None)
            if error is None and tokens:
                error = self._keep_prefill_logprobs(rid, out, comp.logprobs, tokens[:1])
            if error is not None or not tokens:
                self._release(rid)
                loop.call_soon_threadsafe(set_exception, fut,
                                          error or RuntimeError(f"vLLM gave no first token for {rid!r}"))
            else:
                self._prefill_cached[rid] = cached
                loop.call_soon_threadsafe(set_result, fut, tokens[0])
            return
        reason = comp.finish_reason if comp is not None else None
        k, prompt_k = (self._ks.pop(rid, None) if out.finished else self._ks.get(rid)) or (None, None)
        try:
            lps = sample_logprobs(tokens, comp.logprobs, k) if comp is not None else None
            prompt_lps = prompt_logprobs(list(out.prompt_token_ids or ()), out.prompt_logprobs, prompt_k)
        except ValueError as exc:  # vLLM's logprobs do not fit its tokens: end the request with the reason
            self._abort(rid)
            self._deliver(RequestOutput(rid, [], finished=True, finish_reason="abort", error=str(exc)))
            return
        if out.finished and reason == "stop" and not isinstance(comp.stop_reason, str) and tokens:
            tokens = tokens[:-1]  # pdserve leaves stop tokens out of the output
            lps = lps[:-1] if lps is not None else None
        if out.finished:
            self.bridge.forget(rid)
        self._deliver(RequestOutput(rid, tokens, finished=out.finished, finish_reason=reason if out.finished else None,
                                    num_prompt_tokens=len(out.prompt_token_ids or ()), logprobs=lps,
                                    prompt_logprobs=prompt_lps, num_cached_tokens=out.num_cached_tokens or 0))

    def _keep_prefill_logprobs(self, rid: str, out, positions, first: list[int]) -> Exception | None:
        """Keeps a finished prefill_only request's first-token and prompt logprobs (when it asked) until release."""
        k, prompt_k = self._ks.pop(rid, None) or (None, None)
        try:
            lps = sample_logprobs(first, positions[:1] if positions is not None else None, k)
            prompt_lps = prompt_logprobs(list(out.prompt_token_ids or ()), out.prompt_logprobs, prompt_k)
        except ValueError as exc:
            return exc
        if prompt_k is not None and prompt_lps is None:
            return RuntimeError(f"vLLM gave no prompt logprobs for {rid!r}")
        if lps:
            self._first_logprobs[rid] = lps[0]
        if prompt_lps is not None:
            self._prompt_logprobs[rid] = prompt_lps
        return None

    def _ask(self, rid: str, sampling) -> None:
        ks = (getattr(sampling, "logprobs", None), getattr(sampling, "prompt_logprobs", None))
        if ks != (None, None):
            self._ks[rid] = ks

    def _step(self) -> list:
        self._busy_clock.begin()
        try:
            outputs = self.llm.step()
        finally:
            self._busy_clock.end()
        self._num_requests = self._scheduler.get_num_unfinished_requests() + len(self.bridge.prefills)
        return outputs

    def _busy(self) -> bool:
        return self.llm.has_unfinished_requests() or self._scheduler.has_requests() or self.bridge.has_held()

class _Greedy:
    """Placeholder sampling of a reservation (the real one arrives with add_prefilled)."""

    def __init__(self, max_tokens: int):
        self.max_tokens, self.temperature, self.top_p, self.top_k, self.seed = max_tokens, 0.0, 1.0, 0, None
        self.stop, self.stop_token_ids, self.ignore_eos, self.grammar = [], [], True, None
        self.logprobs = self.prompt_logprobs = None
