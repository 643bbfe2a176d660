"""LocalFallback: the policy when no decode serves a request and ``local_fallback`` is on.

The ``RequestConductor``'s outcome "local fallback" (conductor.py): a request no decode took
within ``max_attempts`` tries (or whose decode failed mid-stream and none took it back) is decoded
by this process's colocated engine, after the tokens already produced (``resumed``); it never
waits in line for a decode. One per prefill (``wiring.build_node``; ``ConductorDeps.fallback``,
None while local fallback is off): counted in its ``running`` (``PrefillNode.local_requests``) while
it runs and in the ``local_fallbacks`` metric (reason ``no_decode`` or ``decode_failed``). Raises
``DecodeFailed`` when the engine fails, ``NoDecodeAvailable`` when it has no free KV blocks for the
request.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, AsyncGenerator

from .decode_session import DecodeFailed, Delta, NoDecodeAvailable
from .mid_stream_resume import resumed

if TYPE_CHECKING:
    from pdserve.engine import SamplingParams
    from pdserve.engine.server_engine import ServerEngine
    from pdserve.metrics import ServerMetrics

log = logging.getLogger(__name__)

__all__ = ["LocalFallback"]


class LocalFallback:
    """One prefill's local fallback (module docstring)."""

    def __init__(self, engine: ServerEngine, out_of_blocks_error: type[Exception],
                 metrics: ServerMetrics | None = None):
        self.engine, self.out_of_blocks_error, self.metrics = engine, out_of_blocks_error, metrics
        self.running = 0  # requests decoding on our engine now

    async def deltas(self, request_id: str, prompt_ids: list[int], produced: list[int], sp: SamplingParams,
                     reasons: list[str], after_failure: bool) -> AsyncGenerator[Delta, None]:
        if self.metrics is not None:
            self.metrics.local_fallbacks.labels(reason="decode_failed" if after_failure else "no_decode").inc()
        log.info("request %s: decoding locally (%s)", request_id, "; ".join(reasons))
        self.running += 1
        sp_now = resumed(sp, len(produced))
        outputs = self.engine.generate(f"{request_id}.local", prompt_ids + produced, sp_now)
        try:
            async for out in outputs:
                if out.error:
                    raise DecodeFailed(f"local decoding failed: {out.error}")
                yield Delta(list(out.new_token_ids), out.finished, out.finish_reason if out.finished else None,
                            out.logprobs, out.prompt_logprobs, out.num_cached_tokens)
                if out.finished:
                    return
        except self.out_of_blocks_error as exc:
            raise NoDecodeAvailable(f"local fallback cannot take the request: {exc}") from None
        finally:
            await outputs.aclose()
            self.running -= 1
