"""Every test hook of the servers, in one module: the variables that turn them on (none is ever
set in production), read when the part that uses them is built or reached, never at import.

| variable                              | the hook                                                     | where       |
|---------------------------------------|--------------------------------------------------------------|-------------|
| ``PDSERVE_TEST_GATE_AFTER_ALLOCATION`` | the prefill holds a request after its decode's Allocation     | prefill_server/decode_session.py |
| ``PDSERVE_TEST_LAYER_GATE``            | the prefill's engine holds a P/D prompt after its first layer's KV was handed to the CacheStore, before it computes the next layer | prefill_server/decode_session.py |
| ``PDSERVE_TEST_DECODE_GATE``           | the decode holds a P/D request before it joins its batch      | decode_server/session.py |
| ``PDSERVE_TEST_DECODE_FINISH_GATE``    | the decode holds a P/D request after its Finish went out, before its engine stream closes | decode_server/session.py |
| ``PDSERVE_TEST_KVPOOL_GATE``           | a KV-pool decode holds a pooled request once its loans are taken | kvpool/pooled.py |
| ``PDSERVE_TEST_PLANNER_GATE``          | ``pdserve up --autoscale``'s planner neither observes nor decides until the gate opens | localcluster/up.py |
| ``PDSERVE_TEST_DECODE_STEP_FLOOR_S``   | every decode step with a running batch lasts at least this long | LsoController(step_floor_s=) |
| ``PDSERVE_TEST_PREFILL_STEP_FLOOR_S``  | every step of the prefill's engine lasts at least this long     | AsyncLLMEngine.step_floor_s (server_setup.py) |
| ``PDSERVE_TEST_CORRUPT_KV=N``          | the prefill's CacheStore sender (per-rank push: its last rank's) flips one byte of one layer of the next N requests | CacheStoreSender(corrupt_kv=N) |

The gates reach the request paths as a ``TestGates`` (``TestGates.from_environment()``, read once by
each server's wiring and handed down in its deps objects: SessionRunner, SessionDeps, the KV pool's
decode), so no request reads the environment.

A gate is a directory where a held request announces itself with ``held.<request id>`` and waits
until a file ``open`` exists there, then withdraws its file. Tests drive the gates with
tests/harness/gates.py and decode_gate.py. The wait never blocks the event loop, and cancelling
the request ends it. The CacheStore takes its hook through its constructor (it imports nothing
of the runtime); the prefill's wiring reads it here.
"""  # noqa: E501

from __future__ import annotations

import asyncio
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger(__name__)
POLL_S = 0.02
PREFILL_GATE_ENV = "PDSERVE_TEST_GATE_AFTER_ALLOCATION"
DECODE_GATE_ENV = "PDSERVE_TEST_DECODE_GATE"
DECODE_FINISH_GATE_ENV = "PDSERVE_TEST_DECODE_FINISH_GATE"
LAYER_GATE_ENV = "PDSERVE_TEST_LAYER_GATE"
KVPOOL_GATE_ENV = "PDSERVE_TEST_KVPOOL_GATE"
PLANNER_GATE_ENV = "PDSERVE_TEST_PLANNER_GATE"
DECODE_STEP_FLOOR_ENV = "PDSERVE_TEST_DECODE_STEP_FLOOR_S"
PREFILL_STEP_FLOOR_ENV = "PDSERVE_TEST_PREFILL_STEP_FLOOR_S"
CORRUPT_KV_ENV = "PDSERVE_TEST_CORRUPT_KV"


@dataclass(frozen=True, slots=True)
class TestGates:
    """The request-path gates of one server process ("" = off), read once at start."""

    __test__ = False  # (not a pytest test class)
    prefill_after_allocation: str = ""  # PREFILL_GATE_ENV
    layer: str = ""  # LAYER_GATE_ENV
    decode: str = ""  # DECODE_GATE_ENV
    decode_finish: str = ""  # DECODE_FINISH_GATE_ENV
    kvpool: str = ""  # KVPOOL_GATE_ENV

    @classmethod
    def from_environment(cls) -> "TestGates":
        return cls(gate_dir(PREFILL_GATE_ENV), gate_dir(LAYER_GATE_ENV), gate_dir(DECODE_GATE_ENV),
                   gate_dir(DECODE_FINISH_GATE_ENV), gate_dir(KVPOOL_GATE_ENV))


NO_GATES = TestGates()


def gate_dir(env: str) -> str:
    """The gate directory of one hook (``*_GATE_ENV``); "" when the hook is off."""
    return os.environ.get(env, "")


def gate_closed(directory: str) -> bool:
    """True while the gate at ``directory`` holds (a hook that is on and has no ``open`` file yet)."""
    return bool(directory) and not os.path.exists(os.path.join(directory, "open"))


def prefill_step_floor_s() -> float:
    """Seconds every step of the prefill's engine lasts at least (0: off): a long prompt's chunks then take
    long enough that a test's short prompt arrives while they run, on any CPU."""
    return float(os.environ.get(PREFILL_STEP_FLOOR_ENV) or 0)


def decode_step_floor_s() -> float:
    """Seconds every decode step with a running batch lasts at least (0: off). With it a test can miss
    the smallest TBT target a class can state, or keep a stream running for a known time, on any CPU."""
    return float(os.environ.get(DECODE_STEP_FLOOR_ENV) or 0)


def corrupt_kv() -> int:
    """How many requests the prefill's sender corrupts in flight (0: off); a bad value is an error."""
    raw = os.environ.get(CORRUPT_KV_ENV, "").strip()
    if not raw:
        return 0
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{CORRUPT_KV_ENV}={raw!r}: expected a number of requests to corrupt") from None
    return max(n, 0)


def _marker(directory: str, request_id: str) -> str:
    marker = os.path.join(directory, "held." + request_id.replace(os.sep, "_"))
    open(marker, "w").close()
    return marker


def _withdraw(marker: str) -> None:
    try:
        os.unlink(marker)
    except OSError:
        pass


@contextmanager
def _announced(directory: str, request_id: str):
    """The held request's ``held.<request id>`` file while the block runs; yields the ``open`` path to watch."""
    marker = _marker(directory, request_id)
    try:
        yield os.path.join(directory, "open")
    finally:
        _withdraw(marker)


def hold_thread_at_gate(directory: str, request_id: str) -> None:
    """``wait_at_gate`` for a thread that may block (the engine's, in a layer callback)."""
    with _announced(directory, request_id) as opened:
        while not os.path.exists(opened):
            time.sleep(POLL_S)


async def wait_at_gate(directory: str, request_id: str) -> None:
    """Announce the held request in ``directory``, wait for ``open``, withdraw the announcement."""
    with _announced(directory, request_id) as opened:
        while not os.path.exists(opened):
            await asyncio.sleep(POLL_S)


def hold_at_gate(directory: str, request_id: str) -> None:
    """``wait_at_gate`` for a request served on a thread (it blocks that thread only)."""
    marker = _marker(directory, request_id)
    try:
        while not os.path.exists(os.path.join(directory, "open")):
            time.sleep(POLL_S)
    finally:
        _withdraw(marker)
