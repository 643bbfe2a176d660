"""Bridge: what the vLLM engine adapter and the two halves of PdserveConnector share.

vLLM runs in the server's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one CPU worker), so
the scheduler-side connector, the worker-side connector and ``VllmAsyncEngine`` are three
objects of one process. They meet here, through ``BRIDGES[key]`` (the key travels in
``kv_connector_extra_config``). Everything is called on the engine thread except where said.

Prefill side (a request's KV leaves through the CacheStore):
- ``start_prefill(rid, on_layer)`` before the request is added; the worker's ``save_kv_layer``
  calls ``layer_saved(layer, {rid: block_ids})`` in the step that computes the prompt; an
  error of ``on_layer`` is kept in ``prefill_errors`` (vLLM's step must not raise).
- vLLM keeps the blocks after the request finished (``request_finished`` returns True) until
  ``release(rid)``; the worker's ``get_finished`` then reports it sent and vLLM frees them.

Decode side (the KV arrives into vLLM's blocks):
- ``start_decode(rid, num_prompt_tokens, on_blocks)``: the scheduler connector reports the
  prompt tokens past vLLM's local prefix-cache hit as remote (asynchronous load), and
  ``update_state_after_alloc`` hands the prompt's blocks (the hit's first) and the hit's
  length in tokens to ``on_blocks(block_ids, cached)``.
- ``loaded(rid)`` once every layer arrived: the worker's ``get_finished`` reports the load
  done and vLLM schedules the request (it computes the last token, the prefill's first one).
- ``forget(rid)`` on abort or finish.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

BRIDGES: dict[str, "Bridge"] = {}


@dataclass
class Prefill:
    on_layer: Callable[[int, dict[str, list[int]]], None] | None
    internal_id: str | None = None  # vLLM's request id (the pdserve id + a random suffix)
    saved: bool = False             # its layers were handed to on_layer
    held: bool = False              # finished; vLLM keeps its blocks until released
    released: bool = False


@dataclass
class Decode:
    num_prompt_tokens: int
    on_blocks: Callable[[list[int], int], None]
    internal_id: str | None = None
    block_ids: list[int] | None = None
    cached: int = 0  # leading prompt tokens vLLM's prefix cache held (their blocks are not received)
    loaded: bool = False


@dataclass
class Bridge:
    block_size: int
    prefills: dict[str, Prefill] = field(default_factory=dict)
    decodes: dict[str, Decode] = field(default_factory=dict)
    prefill_errors: dict[str, BaseException] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    # ---- prefill ----
    def start_prefill(self, rid: str, on_layer) -> None:
        with self.lock:
            self.prefills[rid] = Prefill(on_layer)

    def layer_saved(self, layer: int, tables: dict[str, list[int]]) -> None:
        """Worker, after ``layer``'s KV of these requests is in their blocks."""
        for rid, block_ids in tables.items():
            p = self.prefills.get(rid)
            if p is None or p.on_layer is None or rid in self.prefill_errors:
                continue
            try:
                p.on_layer(layer, list(block_ids), 0)  # every block of the prompt, from its first
            except BaseException as exc:  # noqa: BLE001 - reported by prefill_only, not raised into vLLM
                self.prefill_errors[rid] = exc

    def release(self, rid: str) -> bool:
        with self.lock:
            p = self.prefills.get(rid)
            if p is None:
                return False
            p.released = True
            if not p.held:  # never held (aborted, failed): nothing for vLLM to free
                del self.prefills[rid]
            return True

    def take_released(self) -> set[str]:
        """Worker ``get_finished``: vLLM ids of held requests released since the last call."""
        out = set()
        with self.lock:
            for rid, p in list(self.prefills.items()):
                if p.held and p.released:
                    out.add(p.internal_id)
                    del self.prefills[rid]
        return out

    def has_held(self) -> bool:
        with self.lock:
            return any(p.held for p in self.prefills.values())

    # ---- decode ----
    def start_decode(self, rid: str, num_prompt_tokens: int, on_blocks) -> None:
        with self.lock:
            self.decodes[rid] = Decode(num_prompt_tokens, on_blocks)

    def loaded(self, rid: str) -> None:
        with self.lock:
            self.decodes[rid].loaded = True

    def take_loaded(self) -> set[str]:
        """Worker ``get_finished``: vLLM ids whose KV arrived (reported once)."""
        out = set()
        with self.lock:
            for d in self.decodes.values():
                if d.loaded and d.internal_id is not None:
                    out.add(d.internal_id)
                    d.internal_id = None
        return out

    def forget(self, rid: str) -> None:
        with self.lock:
            self.decodes.pop(rid, None)
            p = self.prefills.get(rid)
            if p is not None and not p.held:
                del self.prefills[rid]
            self.prefill_errors.pop(rid, None)
