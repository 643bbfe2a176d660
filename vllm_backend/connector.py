"""PdserveConnector: pdserve's CacheStore plugged into vLLM through ``KVConnectorBase_V1``.

Loaded by vLLM from ``kv_connector_module_path="pdserve.vllm_backend.connector"``; imported
only inside the vLLM environment. Both roles live in the server's process and talk to the
engine adapter through a ``Bridge`` (``bridge.py``); a request takes part when its
``kv_transfer_params`` carry ``{"pdserve": "prefill" | "decode", "rid": ...}``.

Scheduler side:
- ``get_num_new_matched_tokens``: a decode request's prompt tokens past vLLM's local prefix-cache
  hit are remote, loaded asynchronously (vLLM puts it in WAITING_FOR_REMOTE_KVS and allocates
  their blocks);
- ``update_state_after_alloc``: the prompt's blocks and the hit go to the adapter (the CacheStore
  receives into the blocks after the hit);
- ``build_connector_meta``: the prefill requests whose prompt completes in this step, with
  their prompt blocks (the worker hands each layer of them to the CacheStore);
- ``request_finished``: a finished prefill request keeps its blocks (True) until released.

Worker side:
- ``register_kv_caches``: layer name -> layer index (vLLM 0.32 lays every layer of the pool
  out in one tensor, ``(layer * num_blocks + block) * block_bytes`` as pdserve's KVLayout, so
  the CacheStore registers vLLM's own memory: no staging copy);
- ``save_kv_layer``: right after a layer's KV is written, ``Bridge.layer_saved`` (the
  prefill's ``on_layer`` pushes it, as the built-in engine's layer callback does);
- ``start_load_kv`` / ``wait_for_layer_load``: nothing; the CacheStore wrote the blocks before
  ``get_finished`` reported the load done;
- ``get_finished``: released prefills (sent) and decodes whose KV arrived (received).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                KVConnectorRole)
from vllm.v1.request import RequestStatus

from pdserve.engine.block_manager import blocks_needed

from .bridge import BRIDGES, Bridge

_DONE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)

_LAYER_NUMBER = re.compile(r"\.(\d+)\.")


@dataclass
class PdserveMetadata(KVConnectorMetadata):
    saves: dict[str, list[int]] = field(default_factory=dict)  # pdserve rid -> prompt block ids


def _params(request) -> dict | None:
    params = request.kv_transfer_params
    if isinstance(params, dict) and params.get("pdserve") in ("prefill", "decode"):
        return params
    return None


class PdserveConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        key = self._kv_transfer_config.kv_connector_extra_config.get("bridge")
        if key not in BRIDGES:
            raise RuntimeError(f"PdserveConnector: no pdserve bridge {key!r} in this process "
                               "(vLLM must run in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        self.bridge: Bridge = BRIDGES[key]
        self._requests: dict[str, Any] = {}  # scheduler: pdserve prefill rid -> vLLM Request
        self._layers: dict[str, int] = {}    # worker: layer name -> index

    # ---- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = _params(request)
        if params is None:
            return 0, False
        rid = params["rid"]
        if params["pdserve"] == "prefill":
            p = self.bridge.prefills.get(rid)
            if p is not None:
                p.internal_id = request.request_id
                self._requests[rid] = request
            return 0, False
        d = self.bridge.decodes.get(rid)
        if d is None or d.block_ids is not None:  # already allocated (second call after the load)
            return 0, False
        d.internal_id = request.request_id
        d.cached = num_computed_tokens  # the reservation kept hashes for fewer than num_prompt_tokens (engine.py)
        return d.num_prompt_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        params = _params(request)
        if params is None or params["pdserve"] != "decode" or num_external_tokens == 0:
            return
        d = self.bridge.decodes.get(params["rid"])
        if d is None or d.block_ids is not None:
            return
        ids = blocks.get_block_ids()[0]
        d.block_ids = list(ids[:blocks_needed(d.num_prompt_tokens, self.bridge.block_size)])
        d.on_blocks(d.block_ids, d.cached)

    def build_connector_meta(self, scheduler_output) -> PdserveMetadata:
        meta = PdserveMetadata()
        for rid, request in list(self._requests.items()):
            p = self.bridge.prefills.get(rid)
            if p is None or p.saved:
                self._requests.pop(rid, None)
                continue
            scheduled = scheduler_output.num_scheduled_tokens.get(request.request_id, 0)
            if scheduled and request.num_computed_tokens + scheduled >= request.num_prompt_tokens:
                ids = self._kv_cache_manager.get_block_ids(request.request_id)[0]
                meta.saves[rid] = list(ids[:blocks_needed(request.num_prompt_tokens, self.bridge.block_size)])
                p.saved = True
                self._requests.pop(rid, None)
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        params = _params(request)
        if params is None:
            return False, None
        rid = params["rid"]
        self._requests.pop(rid, None)
        if params["pdserve"] == "prefill":
            with self.bridge.lock:
                p = self.bridge.prefills.get(rid)
                if p is not None and p.saved and not p.released and request.status in _DONE:
                    p.held = True  # vLLM keeps the blocks until release(rid) -> get_finished
                    return True, None
        return False, None

    def has_pending_push_work(self) -> bool:
        return self.bridge.has_held()  # keep the engine stepping so get_finished reports releases

    # ---- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]):
        for name in kv_caches:
            m = _LAYER_NUMBER.search(name)
            if m is None:
                raise RuntimeError(f"PdserveConnector: cannot tell the layer index of {name!r}")
            self._layers[name] = int(m.group(1))

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if meta.saves:
            self.bridge.layer_saved(self._layers[layer_name], meta.saves)

    def wait_for_save(self):
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.bridge.take_released() or None, self.bridge.take_loaded() or None
