"""ServerEngine: what the prefill and decode servers call on an engine, declared once.

Two engines implement it, each as the one object the servers get: the built-in
``async_engine.AsyncLLMEngine`` (which runs ``LLMEngine`` and its ``engine.pd`` primitives on its
engine thread) and vLLM's ``vllm_backend/engine.py: VllmAsyncEngine``.
``tests/unit/test_server_engine.py`` checks that both have every member below with the same
parameters and the same kind (coroutine, stream, plain call). The members are the calls found
in ``prefill_server/``, ``decode_server/`` and ``pdserve/server_setup.py``; the lifecycle and
who frees what are ``async_engine.py``'s docstring; in short:

* ``start`` / ``stop``: the engine thread (``stop`` aborts whatever is still held);
* colocated: ``generate`` streams a request's outputs (the prefill's local fallback); each stream
  is an async generator: the caller ``aclose``s one it leaves unfinished, which aborts the request;
* prefill side of P/D: ``prefill_only`` computes a prompt (``on_layer`` is called on the engine
  thread after each layer of each chunk, with the blocks that chunk completed, for the layer-wise
  KV push) and holds its blocks until ``release``;
  ``prefill_logprob`` / ``prefill_prompt_logprobs`` / ``prefill_cached_tokens`` read what the prompt's pass gave;
* decode side: ``reserve`` / ``reserve_prefix`` hold blocks for a request whose KV is coming, then
  ``add_prefilled`` (the prefill computed the prompt) or ``prefill_reserved`` (compute the blocks
  this decode lacks) joins it to the batch and streams its tokens;
* ``abort`` frees whatever a request holds; the plain reads (``num_free_blocks`` and the others
  without ``async``) answer from any thread without a trip to the engine thread.

Not declared, because only one engine has them and the caller checks which it has: the built-in
engine's ``engine`` (the LLMEngine: the KV pool's tensor for the CacheStore, its block manager's
KV events, kvpool's ``EngineOnThread``), ``call_blocking`` (kvpool) and ``after_step`` (the
decode's LSO eviction); vLLM's ``publish_kv_events`` (``server_setup.attach_kv_events``).
"""

from __future__ import annotations

from typing import AsyncGenerator, Callable, Protocol

from .sampling_params import SamplingParams
from .sequence import RequestOutput


class ServerEngine(Protocol):
    num_blocks: int  # the KV pool's size in blocks (constant)

    # ----- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine thread (idempotent)."""

    async def stop(self) -> None:
        """Abort every request still held and join the engine thread."""

    # ----- colocated ---------------------------------------------------------------------
    def generate(self, request_id: str, prompt_token_ids: list[int],
                 sampling: SamplingParams) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs (errors of bad input raise at the first iteration)."""

    # ----- prefill side ------------------------------------------------------------------
    async def prefill_only(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                           on_layer: Callable[[int, list[int], int], None] | None = None,
                           want: Callable[[], None] | None = None) -> int:
        """Compute the prompt (after the prompts queued before it), hold its blocks until ``release``; the
        first token id. ``on_layer(layer, block_ids, first)``: that layer's KV of the prompt
        blocks ``[first, first + len(block_ids))`` is written (each block of each layer once). With ``want``:
        not computed before ``grant``; ``want()`` (on the event loop, once) says the engine would compute it
        now."""

    async def grant(self, request_id: str) -> bool:
        """A ``prefill_only`` request given ``want`` may be computed now; False if it is gone (aborted)."""

    async def prefill_logprob(self, request_id: str):
        """The first token's logprob of a held prompt (None unless its sampling asked)."""

    async def prefill_prompt_logprobs(self, request_id: str) -> list | None:
        """The prompt logprobs of a held prompt (None unless its sampling asked)."""

    def prefill_cached_tokens(self, request_id: str) -> int:
        """The prompt tokens of a held prompt that the prefix cache held (not computed); 0 once released."""

    async def release(self, request_id: str) -> None:
        """Free a held prompt's blocks (its KV was pushed, or the request ended)."""

    # ----- decode side -------------------------------------------------------------------
    async def reserve(self, request_id: str, num_prompt_tokens: int, max_tokens: int) -> list[int]:
        """Hold blocks for a prompt whose KV is coming; their ids."""

    async def reserve_prefix(self, request_id: str, prompt_token_ids: list[int],
                             max_tokens: int) -> tuple[list[int], int]:
        """As ``reserve``, reusing the longest cached prefix: (block ids, tokens already cached)."""

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int], first_token_id: int,
                      sampling: SamplingParams) -> AsyncGenerator[RequestOutput, None]:
        """Join a reserved request whose KV arrived to the batch; stream the tokens after the first."""

    def prefill_reserved(self, request_id: str, prompt_token_ids: list[int],
                         sampling: SamplingParams) -> AsyncGenerator[RequestOutput, None]:
        """Compute a reserved request's missing prompt KV here, then decode; stream every token."""

    async def abort(self, request_id: str):
        """Free whatever the request holds (idempotent)."""

    # ----- reads from any thread ---------------------------------------------------------
    def num_free_blocks(self) -> int: ...
    def num_requests(self) -> int: ...
    def prefill_counters(self) -> tuple[int, float]: ...
    def prefix_hit_tokens(self) -> int: ...
    def swapped(self) -> tuple[int, int]: ...
    def tier_stats(self) -> dict: ...

    def busy_seconds(self) -> float:
        """Seconds the engine spent running steps since start (steps never overlap: its growth over a window
        is at most the window), the step in progress up to now."""

    async def stats(self) -> dict:
        """Free/total blocks and request counts, read on the engine thread."""
