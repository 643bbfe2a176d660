"""The data thread of a ``nixl`` link: chunks become NIXL WRITEs into the receiver's region.

A ``NixlWriter`` is built by its ``Link`` (``link.py``) with exactly what it uses: the
sender's NIXL agent (``NixlMemory``), the local region and layout, the receiver's endpoint
(agent metadata, region descriptor, block count), and three callbacks into the link:
``take`` (pop a batch of chunks from the link's scheduler, or None once the link is down),
``chunk_done`` (a popped chunk is finished; ``acked`` when NIXL reported its WRITE DONE)
and ``stall_error`` (the error that names a stall). ``run()`` returns when the link is down
and raises on any failure; the link's thread then fails the link. TCP stays the control
channel (``link.py``).

One WRITE carries consecutive chunks up to ``chunk_blocks`` blocks (at most 64 chunks), so
short transfers do not each pay a WRITE's fixed cost; its notification lists every
(request, layer, blocks) it carries, with each slice's CRC32C when ``checksum`` is on
(computed right before posting). At most ``NIXL_MAX_OUTSTANDING`` WRITEs are in flight.

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
from .scheduler import Chunk
from .wire_io import RegionIO

log = logging.getLogger("pdserve.cachestore.link")  # the link's logger: this is its data thread
NIXL_MAX_OUTSTANDING = 4  # WRITEs in flight per link
MAX_CHUNKS_PER_WRITE = 64


class NixlWriter:
    """One nixl link's data thread: ``run()`` in that thread (see the module docstring)."""

    def __init__(self, nixl: Any, region: MemoryRegion, layout: KVLayout, endpoint: Endpoint, peer: str, *,
                 chunk_blocks: int, checksum: bool, stall_timeout_s: float,
                 take: Callable[[int, int, bool], list[Chunk] | None],
                 chunk_done: Callable[[Chunk, bool], None],
                 stall_error: Callable[[str], BaseException]):
        self.nixl = nixl                # the sender's NixlMemory: agent, mem_type
        self.region = region
        self.layout = layout
        self.endpoint = endpoint        # nixl_metadata, nixl_region, num_blocks of the receiver
        self.remote_base, _, self.remote_dev, self.remote_type = endpoint.nixl_region
        self.peer = peer
        self.chunk_blocks = chunk_blocks
        self.checksum = checksum
        self.stall_timeout_s = stall_timeout_s
        self.take = take                # (max_blocks, max_chunks, wait) -> chunks, or None: the link is down
        self.chunk_done = chunk_done    # (chunk, acked)
        self.stall_error = stall_error  # (what) -> the error to raise

    def run(self) -> None:
        """Post and poll WRITEs until the link is down; raises on a failed WRITE or a stall."""
        agent = self.nixl.agent
        remote_name = agent.add_remote_agent(self.endpoint.nixl_metadata)
        io = RegionIO(self.region)
        outstanding: collections.deque = collections.deque()
        last_progress = time.monotonic()  # a WRITE completed, or posted with none in flight
        try:
            while True:
                full = len(outstanding) >= NIXL_MAX_OUTSTANDING
                batch = self.take(self.chunk_blocks, 0 if full else MAX_CHUNKS_PER_WRITE, not outstanding)
                if batch is None:
                    return
                if batch:
                    local, remote, records, scratch = self._descs(agent, io, batch)
                    handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, self.nixl.mem_type),
                                                   agent.get_xfer_descs(remote, self.remote_type), remote_name,
                                                   encode_notif(records, self.checksum))
                    if agent.transfer(handle) == "ERR":
                        handle.release()
                        _release_scratch(agent, scratch)
                        for c in batch:
                            self.chunk_done(c, False)
                        raise TransferError(f"NIXL WRITE to {self.peer} failed to post")
                    if not outstanding:
                        last_progress = time.monotonic()
                    outstanding.append((handle, batch, scratch))
                progressed = False
                while outstanding:
                    handle, done, scratch = outstanding[0]
                    state = agent.check_xfer_state(handle)
                    if state == "PROC":
                        break
                    outstanding.popleft()
                    handle.release()
                    _release_scratch(agent, scratch)
                    for c in done:
                        self.chunk_done(c, state == "DONE")
                    progressed = True
                    if state != "DONE":
                        raise TransferError(f"NIXL WRITE to {self.peer} for request(s) "
                                            f"{sorted({c.transfer.key for c in done})} failed")
                if progressed:
                    last_progress = time.monotonic()
                elif not batch and outstanding and time.monotonic() - last_progress > self.stall_timeout_s:
                    # the receiver's agent makes no progress (frozen): fail the link; the
                    # finally below releases the handles (NIXL aborts what it can)
                    raise self.stall_error(f"NIXL WRITE for request(s) "
                                           f"{sorted({c.transfer.key for c in outstanding[0][1]})}")
                if not progressed and not batch:
                    # check_xfer_state also drives UCX progress, so poll back to back
                    # (as a raw NIXL loop does) and only yield the GIL in between
                    time.sleep(0)
        finally:
            for handle, done, scratch in outstanding:
                try:
                    handle.release()
                    _release_scratch(agent, scratch)
                except Exception:  # noqa: BLE001 - best effort while failing
                    pass
                for c in done:
                    self.chunk_done(c, False)
            try:
                agent.remove_remote_agent(remote_name)
            except Exception:  # noqa: BLE001
                pass

    def _descs(self, agent, io: RegionIO, batch: list[Chunk]) -> tuple[list, list, list, list]:
        """One WRITE's local and remote descriptors, its notification records and test-hook scratch copies."""
        base, rdev = self.remote_base, self.remote_dev
        num_blocks = self.endpoint.num_blocks
        layout, region = self.layout, self.region
        bnb = layout.block_nbytes
        local, remote, records, scratch = [], [], [], []
        for c in batch:
            t = c.transfer
            slices = []
            for s, d, n in c.slices:
                src_off, dst_addr = layout.offset(t.layer, s), base + (t.layer * num_blocks + d) * bnb
                crc = io.crc(src_off, n * bnb) if self.checksum else 0
                slices.append((d, n, crc))
                if t.corrupt:  # test hook: the first block goes from a flipped copy
                    t.corrupt = False
                    copy = _corrupt_copy(agent, io, src_off, bnb, t)
                    if copy is not None:
                        scratch.append(copy)
                        local.append((copy[0], bnb, 0))
                        remote.append((dst_addr, bnb, rdev))
                        src_off, dst_addr, n = src_off + bnb, dst_addr + bnb, n - 1
                        if n == 0:
                            continue
                local.append((region.ptr + src_off, n * bnb, region.device_id))
                remote.append((dst_addr, n * bnb, rdev))
            records.append((t.key, t.layer, slices))
        return local, remote, records, scratch


def _corrupt_copy(agent, io: RegionIO, offset: int, nbytes: int, transfer) -> tuple | None:
    """Test hook (checksum.py): a registered host copy of nbytes from offset with one byte flipped.

    Returns (address, the copy, its NIXL registration), or None for a cuda region (not supported)."""
    if io.region.device != "cpu":
        log.warning("TEST HOOK: %s is not supported on cuda regions with nixl; nothing corrupted",
                    "PDSERVE_TEST_CORRUPT_KV")
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
