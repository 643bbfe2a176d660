"""EngineOnThread: the LLMEngine calls kvpool makes, for an engine an AsyncLLMEngine's thread owns.

``BlockLender`` and ``PooledRequest`` were written against a plain ``LLMEngine`` guarded by a
lock (``pdserve kvpool node``). In ``pdserve decode --kv-pool`` the engine belongs to the
AsyncLLMEngine's thread, which steps the continuous batch; this view gives kvpool the same
few members: ``pd.reserve`` (the engine's P/D primitive, ``engine/pd_hooks.py``) and ``abort``
run on the engine thread between steps (``AsyncLLMEngine.call_blocking``), ``num_free_blocks``
reads the published count. The model, the KV cache and the sizes are shared as they are: a
reservation's (or loan's) blocks are written and read only by the pooled request (or lender)
holding them, never by a step.
"""

from __future__ import annotations

from pdserve.engine.async_engine import AsyncLLMEngine

ENGINE_CALL_TIMEOUT_S = 30.0  # an engine call waits at most this long for the engine thread


class EngineOnThread:
    def __init__(self, engine: AsyncLLMEngine):
        self._async = engine
        inner = engine.engine
        self.model, self.kv_cache, self.model_config = inner.model, inner.kv_cache, inner.model_config
        self.block_size, self.max_model_len, self.device = inner.block_size, inner.max_model_len, inner.device
        self._inner = inner
        self.pd = PDOnThread(engine)

    @property
    def num_blocks(self) -> int:
        return self._async.num_blocks

    @property
    def eos_ids(self) -> set[int]:
        return self._inner.eos_ids  # fixed after start-up

    def num_free_blocks(self) -> int:
        return self._async.num_free_blocks()

    def num_requests(self) -> int:
        return self._async.num_requests()

    def abort(self, request_id: str) -> bool:
        return self._async.call_blocking(self._inner.abort, request_id, timeout=ENGINE_CALL_TIMEOUT_S)


class PDOnThread:
    """``LLMEngine.pd``'s one call kvpool makes, ``reserve``, on the engine thread."""

    def __init__(self, engine: AsyncLLMEngine):
        self._async, self._pd = engine, engine.engine.pd

    def reserve(self, request_id: str, num_prompt_tokens: int, max_tokens: int) -> list[int]:
        return self._async.call_blocking(self._pd.reserve, request_id, num_prompt_tokens, max_tokens,
                                         timeout=ENGINE_CALL_TIMEOUT_S)
