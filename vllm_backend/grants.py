"""Grants: the prefill side's ``want``/``grant`` for the vLLM engine (``ServerEngine.prefill_only``).

pdserve's own Scheduler keeps a P/D prompt in its line until its decode allocated (``engine/remote_prefill.py``).
vLLM's scheduler has no such line, so here a prompt given ``want`` is held before it reaches vLLM:
``wait`` calls ``want()`` at once and returns when ``grant`` comes; the caller then adds the prompt to vLLM.
"""

from __future__ import annotations

import asyncio
from typing import Callable


class Grants:
    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Event] = {}  # request id -> its grant, until it comes

    async def wait(self, request_id: str, want: Callable[[], None]) -> None:
        granted = self._waiting[request_id] = asyncio.Event()
        try:
            want()
            await granted.wait()
        finally:
            self._waiting.pop(request_id, None)

    def grant(self, request_id: str) -> bool:
        """False when the request is not waiting (gone, or never given ``want``)."""
        granted = self._waiting.get(request_id)
        if granted is not None:
            granted.set()
        return granted is not None
