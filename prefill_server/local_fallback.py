"""LocalFallback: the policy when no decode serves a request and ``local_fallback`` is on.

The ``RequestConductor``'s outcome "local fallback" (conductor.py): a request no decode took
within ``max_attempts`` tries (or whose decode failed mid-stream and none took it back) is decoded
by this process's colocated engine, after the tokens already produced (``resumed``); it never
waits in line for a decode. Counted in ``PrefillNode.local_requests`` while it runs and in the
``local_fallbacks`` metric (reason ``no_decode`` or ``decode_failed``). Raises ``DecodeFailed``
when the engine fails, ``NoDecodeAvailable`` when it has no free KV blocks for the request.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .decode_session import DecodeFailed, Delta, NoDecodeAvailable
from .mid_stream_resume import resumed

if TYPE_CHECKING:
    from .node import PrefillNode

log = logging.getLogger(__name__)

__all__ = ["LocalFallback"]


class LocalFallback:
    """One prefill's local fallback (module docstring)."""

    def __init__(self, node: PrefillNode):
        self.node = node

    async def deltas(self, request_id: str, prompt_ids: list[int], produced: list[int], sp, reasons: list[str],
                     after_failure: bool):
        node = self.node
        if node.metrics is not None:
            node.metrics.local_fallbacks.labels(reason="decode_failed" if after_failure else "no_decode").inc()
        log.info("request %s: decoding locally (%s)", request_id, "; ".join(reasons))
        node.local_requests += 1
        sp_now = resumed(sp, len(produced))
        outputs = node.engine.generate(f"{request_id}.local", prompt_ids + produced, sp_now)
        try:
            async for out in outputs:
                if out.error:
                    raise DecodeFailed(f"local decoding failed: {out.error}")
                yield Delta(list(out.new_token_ids), out.finished, out.finish_reason if out.finished else None,
                            out.logprobs, out.prompt_logprobs, out.num_cached_tokens)
                if out.finished:
                    return
        except node.out_of_blocks_error as exc:
            raise NoDecodeAvailable(f"local fallback cannot take the request: {exc}") from None
        finally:
            await outputs.aclose()
            node.local_requests -= 1
