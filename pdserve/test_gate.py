"""The servers' test gates (never set in production): a directory where a request announces itself
with ``held.<request id>`` and waits until a file ``open`` exists there, then withdraws its file.
The prefill holds a request after its decode's Allocation (prefill_server/decode_session.py), the
decode before a P/D request joins its batch (decode_server/session.py), a KV-pool decode a pooled
request once its loans are taken (kvpool/pooled.py); each reads its own variable.
Tests drive them with tests/harness/gates.py. The wait never blocks the event loop, and cancelling
the request ends it."""

from __future__ import annotations

import asyncio
import os
import time

POLL_S = 0.02


def _marker(directory: str, request_id: str) -> str:
    marker = os.path.join(directory, "held." + request_id.replace(os.sep, "_"))
    open(marker, "w").close()
    return marker


def _withdraw(marker: str) -> None:
    try:
        os.unlink(marker)
    except OSError:
        pass


async def wait_at_gate(directory: str, request_id: str) -> None:
    """Announce the held request in ``directory``, wait for ``open``, withdraw the announcement."""
    marker = _marker(directory, request_id)
    try:
        while not os.path.exists(os.path.join(directory, "open")):
            await asyncio.sleep(POLL_S)
    finally:
        _withdraw(marker)


def hold_at_gate(directory: str, request_id: str) -> None:
    """``wait_at_gate`` for a request served on a thread (it blocks that thread only)."""
    marker = _marker(directory, request_id)
    try:
        while not os.path.exists(os.path.join(directory, "open")):
            time.sleep(POLL_S)
    finally:
        _withdraw(marker)
