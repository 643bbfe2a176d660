"""No ``asyncio.wait_for`` in the product: on Python 3.11 (the one we ship) it drops a cancel that
comes in the same turn as its awaitable's result, and the cancelled task runs on. That is how a
client that hung up mid-stream left its stream decoding to the end (CI, test_pd_reuse_failures), and
how BatchRunner.stop once waited for ever. ``async with asyncio.timeout(t):`` counts cancels and
raises the caller's; every bounded wait in the product uses it.
"""

from __future__ import annotations

import ast
import asyncio
import sys
from pathlib import Path

import pytest

from harness.conditions import settle
from test_import_arrows import PARTS, REPO


async def _cancelled_in_the_turn_its_event_is_set(bounded_wait) -> str:
    event = asyncio.Event()

    async def waiter() -> str:
        await bounded_wait(event)
        return "ran on"

    task = asyncio.create_task(waiter())
    await settle()  # the waiter is in its wait (event-loop rounds, no clock)
    event.set()
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


async def _with_wait_for(event: asyncio.Event) -> None:
    await asyncio.wait_for(event.wait(), 10)


async def _with_timeout(event: asyncio.Event) -> None:
    async with asyncio.timeout(10):
        await event.wait()


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for keeps the cancel from Python 3.12 on")
def test_wait_for_drops_a_cancel_that_comes_with_its_result_on_python_311():
    assert asyncio.run(_cancelled_in_the_turn_its_event_is_set(_with_wait_for)) == "ran on"


def test_asyncio_timeout_keeps_the_cancel():
    assert asyncio.run(_cancelled_in_the_turn_its_event_is_set(_with_timeout)) == "cancelled"


def _wait_for_calls(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), str(path))
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "wait_for"
            and isinstance(n.func.value, ast.Name) and n.func.value.id == "asyncio"]


def test_the_product_never_calls_asyncio_wait_for():
    found = [f"{p.relative_to(REPO)}:{line}" for folder in PARTS for p in sorted((REPO / folder).rglob("*.py"))
             for line in _wait_for_calls(p)]
    assert not found, f"use `async with asyncio.timeout(t):` instead of asyncio.wait_for (see this module): {found}"
