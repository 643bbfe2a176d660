"""The data thread of a ``nixl`` link: chunks become NIXL WRITEs into the receiver's region.

A ``NixlWriter`` is built by its ``Link`` (``link.py``) with exactly what it uses: the
sender's NIXL agent (``NixlMemory``), the local region and layout, the receiver's endpoint
(agent metadata, region descriptor, block count), and three callbacks into the link:
``take`` (pop a batch of chunks from the link's scheduler, or None once the link is down),
``chunks_done`` (the chunks of one WRITE are finished; ``acked`` when NIXL reported it DONE;
booked once per WRITE, not per chunk) and ``stall_error`` (the error that names a stall).
``run()`` returns when the link is down and raises on any failure; the link's thread then
fails the link. TCP stays the control channel (``link.py``).

Few, large WRITEs: a WRITE takes the consecutive chunks queued, up to ``NIXL_WRITE_BYTES``
(at least one chunk; at most 64 chunks), so a layer the scheduler cut into chunks goes back
together (``nixl_plan.py`` groups the chunks per layer and merges the runs and descriptors
adjacent on both sides), short layers share one WRITE instead of each paying a WRITE's fixed
cost, and layers queued behind a busy link go several to a WRITE. Its notification
has one record per (request, layer) it carries, with each merged slice's CRC32C when
``checksum`` is on (computed right before posting). At most ``NIXL_MAX_OUTSTANDING`` WRITEs
are in flight; completions are polled and booked after the next WRITE was posted: back to back for
``SPIN_S`` after the last post or completion, then with a growing sleep between polls
(``WAIT_MIN_S`` to ``WAIT_MAX_S``).

Stalls: a WRITE in flight while no WRITE of the link completes for ``stall_timeout_s``
raises ``stall_error`` (the receiver's agent makes no progress: frozen); every handle still
held is released on the way out (NIXL aborts what it can) and its chunks count as not acked.

Test hook (``checksum.py``): a transfer marked ``corrupt`` sends its first block from a
registered host copy with one byte flipped (cpu regions only); the source is untouched.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable

from .endpoint import Endpoint
from .errors import TransferError
from .memory import KVLayout, MemoryRegion
from .nixl_backend import encode_notif
from .nixl_plan import group_layers, layer_descriptors, merge_runs_ordered
from .scheduler import Chunk
from .wire_io import RegionIO

log = logging.getLogger("pdserve.cachestore.link")  # the link's logger: this is its data thread
NIXL_MAX_OUTSTANDING = 4  # WRITEs in flight per link
MAX_CHUNKS_PER_WRITE = 64
# A WRITE carries queued chunks up to this many bytes. Each WRITE has a fixed cost (here
# about 0.15 ms between WRITEs, and UCX moves 16 MiB WRITEs 3-4% slower than one big one):
# with 16 MiB WRITEs the layer-wise transfer reached 87-90% of one raw WRITE, with 64 MiB
# 93-97% (`pdserve bench cachestore`), while the MoLink priority scheduler's short requests
# behind a long one were delivered no later (`--mixed`: 47-52 against 59 ms median).
NIXL_WRITE_BYTES = 64 << 20
# While WRITEs are in flight and none finished and nothing new came to post, the thread polls
# back to back for SPIN_S after its last post or completion (a stream of WRITEs completes within
# that: one raw WRITE's throughput), then sleeps between polls, from WAIT_MIN_S doubling up to
# WAIT_MAX_S: spinning on, on a prefill with one core, took that core from the forward pass
# computing the next layers for as long as a WRITE waited for the receiver's progress.
SPIN_S = 0.001
WAIT_MIN_S = 0.00005
WAIT_MAX_S = 0.001


class NixlWriter:
    """One nixl link's data thread: ``run()`` in that thread (see the module docstring)."""

    def __init__(self, nixl: Any, region: MemoryRegion, layout: KVLayout, endpoint: Endpoint, peer: str, *,
                 chunk_blocks: int, checksum: bool, stall_timeout_s: float,
                 take: Callable[[int, int, bool], list[Chunk] | None],
                 chunks_done: Callable[[list[Chunk], bool], None],
                 stall_error: Callable[[str], BaseException]):
        self.nixl = nixl                # the sender's NixlMemory: agent, mem_type
        self.region = region
        self.layout = layout
        self.endpoint = endpoint        # nixl_metadata, nixl_region, num_blocks of the receiver
        self.remote_base, _, self.remote_dev, self.remote_type = endpoint.nixl_region
        self.peer = peer
        # one WRITE: up to NIXL_WRITE_BYTES, or a single chunk when that is larger
        self.write_blocks = max(chunk_blocks, NIXL_WRITE_BYTES // layout.block_nbytes)
        self.checksum = checksum
        self.stall_timeout_s = stall_timeout_s
        self.take = take                # (max_blocks, max_chunks, wait) -> chunks, or None: the link is down
        self.chunks_done = chunks_done  # (chunks of one WRITE, acked)
        self.stall_error = stall_error  # (what) -> the error to raise

    def run(self) -> None:
        """Post and poll WRITEs until the link is down; raises on a failed WRITE or a stall."""
        agent = self.nixl.agent
        remote_name = agent.add_remote_agent(self.endpoint.nixl_metadata)
        io = RegionIO(self.region)
        outstanding: collections.deque = collections.deque()
        last_progress = time.monotonic()  # a WRITE completed, or posted with none in flight
        wait_s, last_activity = 0.0, last_progress  # last_activity: a WRITE posted or completed
        try:
            while True:
                # with NIXL_MAX_OUTSTANDING WRITEs in flight only poll (no lock, no scheduler)
                batch = [] if len(outstanding) >= NIXL_MAX_OUTSTANDING else \
                    self.take(self.write_blocks, MAX_CHUNKS_PER_WRITE, not outstanding)
                if batch is None:
                    return
                if batch:
                    handle, scratch = self._post(agent, io, remote_name, batch)
                    if not outstanding:
                        last_progress = time.monotonic()
                    outstanding.append((handle, batch, scratch))
                # check_xfer_state also drives UCX progress (it releases the GIL inside);
                # completions are booked here, after the next WRITE was posted
                progressed = False
                while outstanding:
                    handle, done, scratch = outstanding[0]
                    state = agent.check_xfer_state(handle)
                    if state == "PROC":
                        break
                    outstanding.popleft()
                    handle.release()
                    _release_scratch(agent, scratch)
                    self.chunks_done(done, state == "DONE")
                    progressed = True
                    if state != "DONE":
                        raise TransferError(f"NIXL WRITE to {self.peer} for request(s) "
                                            f"{sorted({c.transfer.key for c in done})} failed")
                now = time.monotonic()
                if progressed:
                    last_progress = now
                if progressed or batch or not outstanding:
                    wait_s, last_activity = 0.0, now
                    continue
                if now - last_activity < SPIN_S:
                    continue
                if now - last_progress > self.stall_timeout_s:
                    # the receiver's agent makes no progress (frozen): fail the link; the
                    # finally below releases the handles (NIXL aborts what it can)
                    raise self.stall_error(f"NIXL WRITE for request(s) "
                                           f"{sorted({c.transfer.key for c in outstanding[0][1]})}")
                wait_s = min(WAIT_MAX_S, max(WAIT_MIN_S, 2 * wait_s))
                time.sleep(wait_s)
        finally:
            for handle, done, scratch in outstanding:
                try:
                    handle.release()
                    _release_scratch(agent, scratch)
                except Exception:  # noqa: BLE001 - best effort while failing
                    pass
                self.chunks_done(done, False)
            try:
                agent.remove_remote_agent(remote_name)
            except Exception:  # noqa: BLE001
                pass

    def _post(self, agent, io: RegionIO, remote_name: str, batch: list[Chunk]) -> tuple[Any, list]:
        """Post one WRITE for ``batch`` (its layers whole, descriptors merged, one notification)."""
        local, remote, records, scratch = self._plan(agent, io, batch)
        handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, self.nixl.mem_type),
                                       agent.get_xfer_descs(remote, self.remote_type), remote_name,
                                       encode_notif(records, self.checksum))
        if agent.transfer(handle) == "ERR":
            handle.release()
            _release_scratch(agent, scratch)
            self.chunks_done(batch, False)
            raise TransferError(f"NIXL WRITE to {self.peer} failed to post")
        return handle, scratch

    def _plan(self, agent, io: RegionIO, batch: list[Chunk]) -> tuple[list, list, list, list]:
        """One WRITE's local and remote descriptors, its notification records (one per layer) and
        test-hook scratch copies."""
        layout, region, bnb = self.layout, self.region, self.layout.block_nbytes
        ranges: list[tuple[int, int, int]] = []
        records, scratch = [], []
        for t, slices in group_layers(batch):
            crcs = [io.crc(layout.offset(t.layer, s), n * bnb) if self.checksum else 0 for s, _, n in slices]
            records.append((t.key, t.layer, t.token, [(d, n, crc) for (_, d, n), crc in zip(slices, crcs)]))
            layer_ranges = layer_descriptors(t.layer, slices, block_nbytes=bnb, src_base=region.ptr,
                                             src_num_blocks=layout.num_blocks, dst_base=self.remote_base,
                                             dst_num_blocks=self.endpoint.num_blocks)
            if t.corrupt:  # test hook: the first block goes from a flipped copy
                t.corrupt = False
                copy = _corrupt_copy(agent, io, layout.offset(t.layer, slices[0][0]), bnb, t)
                if copy is not None:
                    scratch.append(copy)
                    src, dst, n = layer_ranges[0]
                    layer_ranges[0:1] = [(copy[0], dst, bnb)] + ([(src + bnb, dst + bnb, n - bnb)] if n > bnb else [])
            ranges += layer_ranges
        ranges = merge_runs_ordered(ranges)
        local = [(src, n, region.device_id) for src, _, n in ranges]
        remote = [(dst, n, self.remote_dev) for _, dst, n in ranges]
        return local, remote, records, scratch


def _corrupt_copy(agent, io: RegionIO, offset: int, nbytes: int, transfer) -> tuple | None:
    """Test hook (checksum.py): a registered host copy of nbytes from offset with one byte flipped.

    Returns (address, the copy, its NIXL registration), or None for a cuda region (not supported)."""
    if io.region.device != "cpu":
        log.warning("TEST HOOK: corrupting KV in flight is not supported on cuda regions with nixl; nothing corrupted")
        return None
    import numpy as np

    copy = np.frombuffer(io.copy_out(offset, nbytes), dtype=np.uint8)
    copy[0] ^= 0xFF
    addr = copy.__array_interface__["data"][0]
    reg = agent.register_memory([(addr, nbytes, 0, "")], "DRAM")
    log.warning("TEST HOOK: corrupting one byte of request %r layer %d", transfer.key, transfer.layer)
    return addr, copy, reg


def _release_scratch(agent, scratch: list) -> None:
    for _, _, reg in scratch:
        agent.deregister_memory(reg)
    scratch.clear()
