"""The servers' test gates (never set in production): a directory where a request announces itself
with ``held.<request id>`` and waits until a file ``open`` exists there, then withdraws its file.
The prefill holds a request after its decode's Allocation (prefill_server/decode_session.py), the
decode before a P/D request joins its batch (decode_server/session.py); each reads its own variable.
Tests drive them with tests/harness/gates.py. The wait never blocks the event loop, and cancelling
the request ends it."""

from __future__ import annotations

import asyncio
import os

POLL_S = 0.02


async def wait_at_gate(directory: str, request_id: str) -> None:
    """Announce the held request in ``directory``, wait for ``open``, withdraw the announcement."""
    marker = os.path.join(directory, "held." + request_id.replace(os.sep, "_"))
    open(marker, "w").close()
    try:
        while not os.path.exists(os.path.join(directory, "open")):
            await asyncio.sleep(POLL_S)
    finally:
        try:
            os.unlink(marker)
        except OSError:
            pass
