"""Python's garbage collector in a server process: the start-up heap frozen, full collections timed.

A full (generation 2) collection walks every object the collector tracks, and a server holds
about 200,000 of them once it has started (modules, the tokenizer, the model, gRPC and aiohttp):
one such collection took about 100 ms on this box (``gc.collect()`` after importing the servers),
with every thread of the process stopped: a token gap that long in a decode's stream. Python
runs one only once the objects that survived since the last one reach a quarter of the
long-lived ones, so they are rare (none in a P/D pair serving 24 requests of 512 + 64 tokens:
``docs/bench_raw/2026-11-29-house-ab/tools/pd_ab.py``, ``PDSERVE_GC_FREEZE=0`` as one variant), but a
long-running server meets them. vLLM freezes its heap after start-up for the same reason.

``settle(observe)``, called once a server has started and just before it says it is ready:
- collects once and freezes what is left (``gc.freeze``: the permanent generation, which later
  collections skip), unless ``PDSERVE_GC_FREEZE=0`` (to compare);
- times every full collection from then on and hands its seconds to ``observe`` (the
  ``pdserve_gc_full_collection_seconds`` histogram), so a pause shows on the dashboard.
It returns a function that stops the timing (tests that start servers in one process).
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable

ENV_FREEZE = "PDSERVE_GC_FREEZE"


def freeze_enabled() -> bool:
    return os.environ.get(ENV_FREEZE, "1") != "0"


def settle(observe: Callable[[float], None]) -> Callable[[], None]:
    if freeze_enabled():
        gc.collect()
        gc.freeze()
    started = 0.0

    def on_collection(phase: str, info: dict) -> None:
        nonlocal started
        if info.get("generation") != 2:
            return
        if phase == "start":
            started = time.perf_counter()
        elif started:
            observe(time.perf_counter() - started)
            started = 0.0

    gc.callbacks.append(on_collection)
    return lambda: gc.callbacks.remove(on_collection) if on_collection in gc.callbacks else None
