"""A tensor-parallel worker rank: ``python -m pdserve.engine.tp.worker SPEC_JSON`` (started by rank 0, ``ranks.py``).

1. joins the process group through rank 0's TCPStore (``group.py``);
2. loads its shard of the model from the same source as rank 0 (``load_model(..., rank=r)``), applies
   the engine switches, makes its KV cache (rank 0's block count, its own KV heads); if it cannot,
   it writes the one-line reason to the store (``error/<rank>``, which rank 0 reports) and exits 1;
3. waits at the barrier until every rank is ready, then runs each step rank 0 sends
   (the model's forward: the same one, the same collectives) until rank 0 says STOP (exit 0) or
   goes away (its wait fails: exit 1). Its logits are thrown away: rank 0 samples. A step that pushes KV
   sends its heads of the pushed blocks to rank 0 after each layer; blocks that arrived at a decode come
   from rank 0 into its pool (``transfer.py``). With the per-rank push its pool is in a memfd that rank 0
   maps (``rank_pools.py``): a pushing step only syncs after each layer, arrivals need nothing of it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ..kv_cache import KVCache
from ..loader import load_model
from . import rank_pools
from .group import TPGroup
from .ranks import INSTALL, START_TIMEOUT_S, moved, rank_device
from .shm_collectives import ShmCollectives
from .transfer import receive_blocks, send_layer

log = logging.getLogger("pdserve.engine.tp.worker")


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    rank, size = spec["rank"], spec["size"]
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s tp rank {rank} %(levelname)s %(message)s")
    torch.set_num_threads(spec["threads"])
    model_spec = spec["model"]
    device = rank_device(torch.device(model_spec["device"]), rank)
    store = dist.TCPStore("127.0.0.1", spec["port"], size, False, timeout=timedelta(seconds=START_TIMEOUT_S))
    group = TPGroup(store, rank, size, device, spec["timeout_s"])
    try:
        segment = store.get("shm").decode()
        if segment:  # rank 0 made one: open it before the barrier (rank 0 unlinks it after)
            parent = os.getppid()
            group.use_shm(ShmCollectives(segment, rank, size, spec["timeout_s"], lambda: _parent_gone(parent)))
        model, kv = _load(spec, rank, device)
        group.attach(model)
        if kv.shared_fd is not None:  # rank 0 maps it after the barrier (the per-rank push: rank_pools.py)
            rank_pools.publish(store, rank, kv)
    except Exception as exc:  # noqa: BLE001 - rank 0 reports it, in one line
        store.set(f"error/{rank}", f"{type(exc).__name__}: {exc}")
        return 1
    try:
        group.barrier()
        while (message := group.receive()) is not None:
            _serve(message, group, model, kv, device)
    except RuntimeError as exc:  # rank 0 went away, or a collective failed: nothing left to do
        log.warning("stopping: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return 1
    return 0


def _serve(message: tuple, group: TPGroup, model, kv: KVCache, device: torch.device) -> None:
    """One message of rank 0: a step (its forward; its heads of the pushed blocks gathered after each layer),
    or blocks that arrived (its heads of them scattered into its pool): ``transfer.py``."""
    if message[0] == INSTALL:
        receive_blocks(group, kv, message[1], message[2])
        return
    _, batch, extra_rows, blocks, checksum, sync = message
    on_layer = None
    if blocks is not None:  # the gather (a collective: it also says every rank wrote the layer)
        idx = torch.tensor(blocks, dtype=torch.long, device=device)
        on_layer = functools.partial(_send_layer, group, kv, idx, checksum)
    elif sync:  # per-rank pushes only: rank 0's senders read every rank's pool once all wrote the layer
        on_layer = functools.partial(_synced, group)
    model(moved(batch, device), kv, on_layer, [rows.to(device) for rows in extra_rows])


def _send_layer(group: TPGroup, kv: KVCache, blocks: torch.Tensor, checksum: bool, layer: int) -> None:
    send_layer(group, kv, layer, blocks, checksum)


def _synced(group: TPGroup, layer: int) -> None:
    group.sync()


def _parent_gone(parent: int) -> str | None:
    return None if os.getppid() == parent else f"tensor-parallel rank 0 (pid {parent}) exited"


def _load(spec: dict, rank: int, device: torch.device):
    """This rank's model shard (engine switches applied) and its KV cache."""
    m = spec["model"]
    loaded = load_model(m["name_or_path"], dtype=getattr(torch, m["dtype"]), device=device, seed=m["seed"],
                        quantization=m["quantization"], tensor_parallel_size=spec["size"], rank=rank)
    loaded.model.configure(**spec["switches"])
    cfg, kv = loaded.model.cfg, spec["kv"]
    cache = KVCache(cfg.num_layers, kv["num_blocks"], kv["block_size"], cfg.num_kv_heads, cfg.head_dim, loaded.dtype,
                    device, kv["kv_dtype"], kv.get("shared", False))
    return loaded.model, cache


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
