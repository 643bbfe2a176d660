"""How long NIXL takes to BUILD one WRITE handle (not to move it), three ways.

    .venv/bin/python bench/tools/nixl_xfer_build_cost.py

Two agents in this process, 512 MiB registered on each (32 layers x 64 blocks of 256 KiB, the
`pdserve bench cachestore` set). For one layer, in microseconds per handle (median of 5 x 1000):

- ``initialize_xfer`` from one merged descriptor per side (what cachestore/nixl_link.py does);
- ``initialize_xfer`` from 64 per-block descriptors per side (no merging);
- ``make_prepped_xfer`` over lists prepared once with one descriptor per (layer, block) of
  each pool (NIXL's "prepared" API; the preparation's one-off cost is printed too).

This is why cachestore/README.md says the prepared lists are not worth their per-link size.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from pdserve.cachestore.nixl_backend import load_nixl

LAYERS, BLOCKS, BLOCK_NBYTES = 32, 64, 256 << 10
N = 1000


def main() -> None:
    api = load_nixl()

    def agent(name):
        config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                       sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        return api.nixl_agent(name, config)

    nbytes = LAYERS * BLOCKS * BLOCK_NBYTES
    src, dst = torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    tx, rx = agent("cost-tx"), agent("cost-rx")
    tx.register_memory([(src.data_ptr(), nbytes, 0, "")], "DRAM")
    rx.register_memory([(dst.data_ptr(), nbytes, 0, "")], "DRAM")
    remote = tx.add_remote_agent(rx.get_agent_metadata())
    s0, d0 = src.data_ptr(), dst.data_ptr()
    layer_bytes = BLOCKS * BLOCK_NBYTES

    def merged(i):
        layer = i % LAYERS
        return tx.initialize_xfer("WRITE", tx.get_xfer_descs([(s0 + layer * layer_bytes, layer_bytes, 0)], "DRAM"),
                                  tx.get_xfer_descs([(d0 + layer * layer_bytes, layer_bytes, 0)], "DRAM"), remote, b"n")

    def per_block(i):
        base = (i % LAYERS) * layer_bytes
        local = [(s0 + base + b * BLOCK_NBYTES, BLOCK_NBYTES, 0) for b in range(BLOCKS)]
        far = [(d0 + base + b * BLOCK_NBYTES, BLOCK_NBYTES, 0) for b in range(BLOCKS)]
        return tx.initialize_xfer("WRITE", tx.get_xfer_descs(local, "DRAM"), tx.get_xfer_descs(far, "DRAM"), remote,
                                  b"n")

    t0 = time.perf_counter()
    prepped_local = tx.prep_xfer_dlist("NIXL_INIT_AGENT", [(s0 + j * BLOCK_NBYTES, BLOCK_NBYTES, 0)
                                                           for j in range(LAYERS * BLOCKS)], "DRAM")
    prepped_far = tx.prep_xfer_dlist(remote, [(d0 + j * BLOCK_NBYTES, BLOCK_NBYTES, 0)
                                              for j in range(LAYERS * BLOCKS)], "DRAM")
    prep_ms = (time.perf_counter() - t0) * 1e3

    def prepped(i):
        idx = np.arange((i % LAYERS) * BLOCKS, (i % LAYERS + 1) * BLOCKS, dtype=np.int32)
        return tx.make_prepped_xfer("WRITE", prepped_local, idx, prepped_far, idx, b"n")

    for name, build in (("initialize_xfer, 1 merged descriptor", merged),
                        ("initialize_xfer, 64 block descriptors", per_block),
                        ("make_prepped_xfer, 64 prepared blocks", prepped)):
        runs = []
        for _ in range(5):
            t = time.perf_counter()
            for i in range(N):
                build(i).release()
            runs.append((time.perf_counter() - t) / N * 1e6)
        print(f"{name:40} {statistics.median(runs):7.1f} us per handle")
    print(f"(preparing both lists of {LAYERS * BLOCKS} descriptors once: {prep_ms:.1f} ms)")


if __name__ == "__main__":
    main()
