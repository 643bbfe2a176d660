"""aclose_fully: close a request's async generator and let its teardown finish, even if the
task doing it is cancelled meanwhile.

Why: aiohttp cancels a handler when its client disconnects (``handler_cancellation``), and a
client closes the connection as soon as it reads ``[DONE]`` - often while the request's
teardown is still awaiting (half-closing the Session, releasing the engine's blocks). A
cancel landing there skipped the rest of the teardown (the CacheStore delete, the session
registry, the in-flight count): the request stayed held for ever (found by
``pdserve bench chaos --faults stop-prefill``). Every layer that closes the generator below
it uses this, so a teardown runs to its end exactly once; the cancel is re-raised after.
"""

from __future__ import annotations

import asyncio
from typing import AsyncGenerator


async def aclose_fully(agen: AsyncGenerator) -> None:
    closing = asyncio.ensure_future(agen.aclose())
    try:
        await asyncio.shield(closing)
    except asyncio.CancelledError:
        if not closing.done():
            await closing  # the cancel was for us, not for the teardown: let it finish
        raise
